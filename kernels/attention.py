"""Triton attention over a paged KV cache: varlen causal prefill and single-token decode.

Cache layout (both kernels): k_cache / v_cache [num_blocks, page, kv_heads, head_dim]; a sequence's
token j lives in block `block_tables[s, j // page]` at row `j % page`. Keys and values of the current
step are already in the cache when these run, so a prefill chunk attends to earlier chunks and to
itself through the same gather, and query i of a chunk of length L sits at absolute position
context_len - L + i (causal bound).

Both are online-softmax (one pass over the keys, running max and normaliser) with float32
accumulation. Decode is memory-bound: it reads each sequence's keys and values once per kv head
(the query heads of a GQA group share the read), and at small batches splits long contexts into
slices that run in parallel and are combined by a second kernel (flash-decoding).

The serving engine's torch reference (`tp_overlap_plugin.serving.attention`) defines the expected
result; tests run these under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
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
def _decode_kernel(Q, K, V, Out, PartAcc, PartML, context_lens, block_tables,
                   stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                   stride_ot, stride_oh, stride_bt, scale,
                   GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program per (sequence, kv head, split): the GROUP query heads that share a kv head are
    the rows of one tile, so each key/value row is read from memory once for all of them. With
    NUM_SPLITS > 1 the context is cut into NUM_SPLITS slices (whole BLOCK_N tiles each) and the
    program writes its slice's unnormalised accumulator, running max and normaliser to PartAcc and
    PartML for `_decode_reduce_kernel`; with one split it writes the output itself."""
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + s)
    if NUM_SPLITS == 1:
        lo = 0
        hi = ctx
    else:
        per = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(ctx, lo + per)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + s * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables + s * stride_bt
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0)
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # Every tile in [lo, hi) holds at least one key, so the running max is finite after it.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    row_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(Out + s * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_mask)
    else:
        # Row (s, head, split) of PartAcc [S * H * NUM_SPLITS, BLOCK_D] and PartML [..., 2] (float32):
        # the accumulator, and m, l. An empty split (its slice starts past the context) leaves
        # m = -inf, l = 0, acc = 0, which the reduction weighs 0.
        row = ((s * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(PartAcc + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_mask)
        tl.store(PartML + row * 2, m_i, mask=g_mask)
        tl.store(PartML + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(PartAcc, PartML, Out, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """out[s, h] = sum_k acc_k e^(m_k - M) / sum_k l_k e^(m_k - M), M = max_k m_k, over the splits."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    k_mask = offs_k < NUM_SPLITS
    rows = ((s * tl.num_programs(1) + h) * NUM_SPLITS + offs_k).to(tl.int64)
    m = tl.load(PartML + rows * 2, mask=k_mask, other=float("-inf"))
    l = tl.load(PartML + rows * 2 + 1, mask=k_mask, other=0.0)
    # Split 0 always holds key 0 (every context has at least one key), so M is finite.
    w = tl.exp(m - tl.max(m, 0))
    acc = tl.load(PartAcc + rows[:, None] * BLOCK_D + offs_d[None, :], mask=k_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(Out + s * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


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


MAX_SPLITS = 16


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """How many slices each (sequence, kv head) splits its context into: enough programs for ~4 per
    SM. It depends on the batch only through its power-of-two bucket, not on the context lengths,
    so a CUDA graph (captured for a padded batch, replayed with other lengths) and an eager call
    for the same sequences agree bit for bit; a slice past the end of a short context is empty."""
    programs = triton.next_power_of_2(max(num_seqs, 1)) * kv_heads
    return max(1, min(MAX_SPLITS, -(-4 * _num_sms(device) // programs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                           out: Optional[torch.Tensor] = None, block_n: Optional[int] = None,
                           num_splits: Optional[int] = None, num_warps: Optional[int] = None,
                           num_stages: Optional[int] = None) -> torch.Tensor:
    """q [S, H, D], one query per sequence at position context_lens[s] - 1 -> [S, H, D].

    Flash-decoding: one program per (sequence, kv head, context slice) serves all the query heads
    of that kv head (GQA), and with more than one slice a second small kernel combines them."""
    _check(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    s, h, d = q.shape
    if s == 0:
        return out
    kv_heads = k_cache.shape[2]
    group = h // kv_heads
    interp = q.device.type == "cpu"
    splits = num_splits or decode_num_splits(s, kv_heads, q.device)
    bn = block_n or (16 if interp else 64)
    bd = max(16, triton.next_power_of_2(d))
    if splits > 1:
        part_acc = torch.empty((s * h * splits, bd), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((s * h * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out   # unused
    launch = {}
    if num_warps:
        launch["num_warps"] = num_warps
    if num_stages:
        launch["num_stages"] = num_stages
    _decode_kernel[(s, kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, context_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), scale,
        GROUP=group, PAGE=k_cache.shape[1], HEAD_DIM=d, NUM_SPLITS=splits,
        # tl.dot wants at least 16 rows: a group of fewer query heads is padded with masked rows.
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=bn, BLOCK_D=bd,
        PRECISION="ieee" if q.dtype == torch.float32 or interp else "tf32",
        UPCAST=interp and q.dtype != torch.float32, **launch,
    )
    if splits > 1:
        _decode_reduce_kernel[(s, h)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            HEAD_DIM=d, NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=bd,
        )
    return out
