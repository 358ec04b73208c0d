"""Triton attention over a paged KV cache: varlen causal prefill and single-token decode.

Cache layout (both kernels): k_cache / v_cache [num_blocks, page, kv_heads, head_dim]; a sequence's
token j lives in block `block_tables[s, j // page]` at row `j % page`. Keys and values of the current
step are already in the cache when these run, so a prefill chunk attends to earlier chunks and to
itself through the same gather, and query i of a chunk of length L sits at absolute position
context_len - L + i (causal bound).

Both are online-softmax (one pass over the keys, running max and normaliser) with float32
accumulation. The serving engine's torch reference (`tp_overlap_plugin.serving.attention`) defines
the expected result; tests run these under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(Q, K, V, Out, cu_seqlens_q, context_lens, block_tables,
                    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                    stride_ot, stride_oh, stride_bt, scale,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + s)
    q_len = tl.load(cu_seqlens_q + s + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens + s)
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx - q_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the last query of this tile are invisible to all its rows.
    end = tl.minimum(ctx, ctx - q_len + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(block_tables + s * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
        k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        # Key 0 is visible to every row, so after the first tile every running max is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(Q, K, V, Out, context_lens, block_tables,
                   stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                   stride_ot, stride_oh, stride_bt, scale,
                   GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    ctx = tl.load(context_lens + s)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + s * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start_n in range(0, ctx, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < ctx
        blk = tl.load(block_tables + s * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
        k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        qk = tl.sum(k * q[None, :], 1) * scale
        qk = tl.where(n_mask, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))
        p = tl.exp(qk - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    out = acc / l_i
    tl.store(Out + s * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [T, H, D] and caches [blocks, page, kv_heads, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"head dims {q.shape[-1]} vs {k_cache.shape[-1]}, or {q.shape[1]} query heads not a "
                         f"multiple of {k_cache.shape[2]} kv heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a unit-stride last dim, and k/v caches equal strides")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32 with unit-stride rows")
    if q.device != k_cache.device or q.device != block_tables.device:
        raise ValueError("q, caches and block tables must be on one device")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_q_len: int, scale: float, out: Optional[torch.Tensor] = None,
                            block_m: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """q [T, H, D] (sequences packed by cu_seqlens_q [S+1]) -> [T, H, D]."""
    _check(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    s = cu_seqlens_q.numel() - 1
    if s <= 0 or q.shape[0] == 0:
        return out
    h, d = q.shape[1], q.shape[2]
    group = h // k_cache.shape[2]
    interp = q.device.type == "cpu"
    bm = block_m or (16 if interp else 64)
    bn = block_n or (16 if interp else 64)
    bd = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(max_q_len, bm), s, h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), scale,
        GROUP=group, PAGE=k_cache.shape[1], HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        # tf32 would cost float32 models their bit-level agreement with the reference.
        PRECISION="ieee" if q.dtype == torch.float32 or interp else "tf32",
        # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those integers.
        UPCAST=interp and q.dtype != torch.float32,
    )
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                           out: Optional[torch.Tensor] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """q [S, H, D], one query per sequence at position context_lens[s] - 1 -> [S, H, D]."""
    _check(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    s, h, d = q.shape
    if s == 0:
        return out
    bn = block_n or (16 if q.device.type == "cpu" else 64)
    _decode_kernel[(s, h)](
        q, k_cache, v_cache, out, context_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), scale,
        GROUP=h // k_cache.shape[2], PAGE=k_cache.shape[1], HEAD_DIM=d, BLOCK_N=bn,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out
