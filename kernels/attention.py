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

The serving engine's torch reference (`tp_overlap_plugin.serving.model.attention`) defines the expected
result; tests run these under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_keys(acc, l_i, m_i, q, q_pos, K, V, bt_row, kv_head_off, stride_kb, stride_kp, lo, hi, qk_scale,
                  offs_d, d_mask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr, DIAGONAL: tl.constexpr):
    """Keys [lo, hi) of one sequence into a tile's running softmax (log2 domain). Off the diagonal
    (DIAGONAL False) every key is visible to every row and [lo, hi) is whole tiles, so no mask is
    built; on it, the causal bound and the context end are applied per element."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if DIAGONAL:
            n_mask = offs_n < hi
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blk = tl.load(bt_row + offs_n // PAGE)
            kv_mask = d_mask[None, :]
        kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kp + kv_head_off
        k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if DIAGONAL:
            qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], qk, float("-inf"))
        # The caller's first tile starts at or before every row's position, so key `lo` is visible
        # to all rows: after it every running max is finite and exp2(-inf - m) = 0 drops masked keys.
        # The scale is applied to the row max and inside one fused multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# The block table's row stride is the step's widest table, which changes from step to step; Triton
# would specialise it (== 1, divisible by 16, neither) and compile a variant mid-serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, K, V, Out, cu_seqlens_q, context_lens, block_tables,
                    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                    stride_ot, stride_oh, stride_bt, scale,
                    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEADS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    FRESH_FROM: tl.constexpr):
    """One program per (HEADS query heads of one kv head, sequence, tile of BLOCK_M // HEADS query
    tokens). Its BLOCK_M rows are (token, head) pairs, token-major, so with HEADS = GROUP each key
    and value tile is read once for the whole GQA group. The tile axis is the grid's last and is
    walked backwards: the tiles at the end of a prompt see the most keys and are launched first,
    so the short ones fill the tail of the launch. FRESH_FROM > 0: sequences that start fresh
    (context = chunk) of at least FRESH_FROM tokens are left alone (the caller attends to them)."""
    hb = tl.program_id(0)
    s = tl.program_id(1)
    pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
    TOK_M: tl.constexpr = BLOCK_M // HEADS
    q_start = tl.load(cu_seqlens_q + s)
    q_len = tl.load(cu_seqlens_q + s + 1) - q_start
    if pid_m * TOK_M >= q_len:
        return
    ctx = tl.load(context_lens + s)
    if FRESH_FROM > 0:
        if (ctx == q_len) & (q_len >= FRESH_FROM):
            return
    offs_r = tl.arange(0, BLOCK_M)
    tok = pid_m * TOK_M + offs_r // HEADS
    head = hb * HEADS + offs_r % HEADS
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = tok < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx - q_len + tok
    # exp2 with log2(e) folded into the scale: one multiply per score, and exp2 is the native op.
    qk_scale = scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + s * stride_bt
    kv_head_off = (hb * HEADS // GROUP) * stride_kh
    first = ctx - q_len + pid_m * TOK_M
    # Keys before the key tile holding the tile's first query are visible to all its rows; keys
    # from there to the tile's last query need the causal mask; later keys are seen by no row.
    diag = first // BLOCK_N * BLOCK_N
    end = tl.minimum(ctx, first + TOK_M)
    acc, l_i, m_i = _prefill_keys(acc, l_i, m_i, q, q_pos, K, V, bt_row, kv_head_off, stride_kb, stride_kp,
                                  0, diag, qk_scale, offs_d, d_mask, PAGE, BLOCK_N, PRECISION, UPCAST, DIAGONAL=False)
    acc, l_i, m_i = _prefill_keys(acc, l_i, m_i, q, q_pos, K, V, bt_row, kv_head_off, stride_kb, stride_kp,
                                  diag, end, qk_scale, offs_d, d_mask, PAGE, BLOCK_N, PRECISION, UPCAST, DIAGONAL=True)
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["stride_bt"])   # as _prefill_kernel
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


@functools.lru_cache(maxsize=None)
def prefill_config(backend: str, dtype: torch.dtype, group: int) -> dict:
    """Tile sizes and launch settings of `_prefill_kernel`: backend "cuda", "hip" or "cpu" (the
    interpreter). CUDA's were measured on H100 at head_dim 128 (bench/notes/attention.md) and serve
    head_dim 64 too; ROCm's are the CDNA3 habit (one 64 KiB LDS: two stages of a 128 x 64 key tile),
    not measured here."""
    if backend == "cpu":
        return dict(block_m=16, block_n=16, heads=1, num_warps=None, num_stages=None)
    if dtype == torch.float32:   # 4-byte tiles: the old kernel's 64 x 64, within shared memory
        return dict(block_m=64, block_n=64, heads=1, num_warps=4, num_stages=2)
    if backend == "hip":
        return dict(block_m=128, block_n=64, heads=1, num_warps=4, num_stages=2)
    # H100, head_dim 128: 4 warps (one warpgroup) beat 8 at every tile shape, and 32-key tiles beat
    # 64 and 128 (fewer masked keys on the diagonal, smaller live score tile). Packing 4 query heads
    # of a GQA group into a tile's rows was 1-12% faster than one head per program (measured at
    # group 4 only, so larger groups pack 4 heads too).
    heads = 4 if group % 4 == 0 else (2 if group % 2 == 0 else 1)
    return dict(block_m=128, block_n=32, heads=heads, num_warps=4, num_stages=3)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_q_len: int, scale: float, out: Optional[torch.Tensor] = None,
                            block_m: Optional[int] = None, block_n: Optional[int] = None,
                            heads_per_tile: Optional[int] = None, num_warps: Optional[int] = None,
                            num_stages: Optional[int] = None, fresh_from: int = 0) -> torch.Tensor:
    """q [T, H, D] (sequences packed by cu_seqlens_q [S+1]) -> [T, H, D].

    heads_per_tile: query heads of one kv head that share a program (1, or a power-of-two divisor
    of the GQA group); the rest default to `prefill_config`. fresh_from > 0: the rows of sequences
    whose context is their chunk (a fresh prompt) of at least fresh_from tokens are not written
    (serving/model/attention.py attends to those through torch's SDPA); 0 attends to every sequence."""
    _check(q, k_cache, v_cache, block_tables)
    out = torch.empty_like(q) if out is None else out
    s = cu_seqlens_q.numel() - 1
    if s <= 0 or q.shape[0] == 0:
        return out
    h, d = q.shape[1], q.shape[2]
    group = h // k_cache.shape[2]
    interp = q.device.type == "cpu"
    backend = "cpu" if interp else ("hip" if torch.version.hip else "cuda")
    cfg = prefill_config(backend, q.dtype, group)
    bm = block_m or cfg["block_m"]
    bn = block_n or cfg["block_n"]
    heads = heads_per_tile or cfg["heads"]
    if group % heads or heads & (heads - 1) or bm % heads:
        raise ValueError(f"heads_per_tile {heads} must be a power of two dividing the GQA group {group} "
                         f"and the tile's {bm} rows")
    bd = max(16, triton.next_power_of_2(d))
    grid = (h // heads, s, triton.cdiv(max_q_len, bm // heads))
    launch = {k: v for k, v in (("num_warps", num_warps or cfg["num_warps"]),
                                ("num_stages", num_stages or cfg["num_stages"])) if v}
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), scale,
        GROUP=group, PAGE=k_cache.shape[1], HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, HEADS=heads,
        # tf32 would cost float32 models their bit-level agreement with the reference.
        PRECISION="ieee" if q.dtype == torch.float32 or interp else "tf32",
        # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those integers.
        UPCAST=interp and q.dtype != torch.float32, FRESH_FROM=fresh_from, **launch,
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
