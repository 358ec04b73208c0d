"""The decoder layer's memory-bound steps, one kernel each: RMSNorm (with the residual add folded in),
rotary embedding of q and k together with the KV-cache write, and SiLU(gate) * up.

Why: a decode step is a few hundred microsecond-scale kernels per layer, and on our GPUs every
kernel costs a few microseconds even inside a CUDA graph. Written with torch ops these steps were
about 25 kernels per layer; here they are 3 (bench/notes/decode.md has the step time before/after).

Rounding follows the torch reference in serving/model/model.py (which follows HF transformers): the
residual sum and the normalised activations are rounded to the model dtype before the weight
multiplies, and SiLU's output is rounded before the product with up. Rotary is computed in fp32 and
rounded once (the reference rounds after each bf16 multiply), so the two differ by about one ulp.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, stride_x, stride_res, stride_out,
                   stride_res_out, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """out = weight * rmsnorm(x [+ res]); with HAS_RES also res_out = x + res (the new residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


@triton.jit
def rope_cache_kernel(qkv_ptr, stride_t, positions_ptr, cos_ptr, sin_ptr, stride_pos, k_cache_ptr, v_cache_ptr,
                      slot_ptr, stride_slot, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEADS_P2: tl.constexpr, HALF: tl.constexpr):
    """One program per token of a fused qkv row [q heads | k heads | v heads] (head_dim = 2 * HALF):
    rotate q and k in place (rotate-half convention), then store k and v into the paged cache at
    the token's slot (cache rows of KV_HEADS * head_dim elements, `stride_slot` apart)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    d = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * stride_pos + d)[None, :]  # the tables repeat each frequency in both halves
    s = tl.load(sin_ptr + pos * stride_pos + d)[None, :]
    heads = tl.arange(0, HEADS_P2)[:, None]
    hmask = heads < Q_HEADS + KV_HEADS
    row = qkv_ptr + t * stride_t + heads * (2 * HALF) + d[None, :]
    x1 = tl.load(row, mask=hmask, other=0.0)
    x2 = tl.load(row + HALF, mask=hmask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    y1 = (x1 * c - x2 * s).to(dtype)
    y2 = (x2 * c + x1 * s).to(dtype)
    tl.store(row, y1, mask=hmask)
    tl.store(row + HALF, y2, mask=hmask)
    slot = tl.load(slot_ptr + t)
    kv = heads - Q_HEADS
    kmask = (heads >= Q_HEADS) & hmask
    dst = slot * stride_slot + kv * (2 * HALF) + d[None, :]
    tl.store(k_cache_ptr + dst, y1, mask=kmask)
    tl.store(k_cache_ptr + dst + HALF, y2, mask=kmask)
    vrow = qkv_ptr + t * stride_t + (Q_HEADS + KV_HEADS) * (2 * HALF) + (kv * (2 * HALF) + d[None, :])
    vmask = kmask
    tl.store(v_cache_ptr + dst, tl.load(vrow, mask=vmask, other=0.0), mask=vmask)
    tl.store(v_cache_ptr + dst + HALF, tl.load(vrow + HALF, mask=vmask, other=0.0), mask=vmask)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    """out[row] = silu(x[row, :n]) * x[row, n:2n] (gate and up side by side, as gate_up_proj gives them)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


# ---- launchers (the model calls these on GPUs; serving/model/model.py holds the torch reference) ----

def rmsnorm(x, weight, eps: float, residual=None):
    """x [T, n] -> weight * rmsnorm(x); with `residual`, normalises x + residual and returns
    (normed, x + residual)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if t:
        rmsnorm_kernel[(t,)](x, res, out, res_out, weight, x.stride(0), res.stride(0), out.stride(0),
                             res_out.stride(0), n, eps, HAS_RES=residual is not None,
                             BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4)
    return out if residual is None else (out, res_out)


def rope_and_cache(qkv, q_heads: int, kv_heads: int, head_dim: int, positions, cos, sin, k_cache, v_cache,
                   slot_mapping) -> None:
    """In place on qkv [T, (q_heads + 2 kv_heads) * head_dim]: rotate q and k; k, v into the cache."""
    t = qkv.shape[0]
    if t:
        rope_cache_kernel[(t,)](qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), k_cache, v_cache,
                                slot_mapping, k_cache.stride(1), Q_HEADS=q_heads, KV_HEADS=kv_heads,
                                HEADS_P2=triton.next_power_of_2(q_heads + kv_heads), HALF=head_dim // 2,
                                num_warps=4)


def silu_mul(x):
    """x [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
    t, two_n = x.shape
    n = two_n // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = 1024
    if t:
        silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out
