"""Paged attention: per-step metadata, the KV-cache write, and the torch reference path.

Token layout of a step: the first `num_decodes` sequences contribute one token each (decode), the
remaining sequences contribute a chunk of prompt (or recomputed) tokens. Every sequence's keys and
values for the tokens of this step are written into the paged cache *before* attention runs, so
attention always reads keys/values from the cache, and a chunk of a long prompt sees the earlier
chunks exactly like a decode token sees its history.

On CUDA the Triton kernels in `tp_overlap_plugin.kernels.attention` are used, except for prompts
that start fresh in the step (no cached prefix: their context is the chunk itself), which attend
over their own keys through torch's SDPA (see `FreshPlan`); on CPU the torch reference below (which
the kernel tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor        # [T] int64, flat cache slot of every token of the step
    num_decodes: int                  # the first num_decodes sequences have exactly one query token
    cu_seqlens_q: torch.Tensor        # [S+1] int32 offsets of each sequence's tokens in the step
    context_lens: torch.Tensor        # [S] int32, tokens in the cache for the sequence after this step
    block_tables: torch.Tensor        # [S, max_blocks] int32
    max_q_len: int
    # Python copies for the CPU path, which loops over prefill sequences.
    q_lens_list: Optional[list[int]] = None
    context_lens_list: Optional[list[int]] = None
    use_triton: bool = False
    _prompts: Optional[tuple] = field(default=None, repr=False, compare=False)
    _fresh: dict = field(default_factory=dict, repr=False, compare=False)

    def prompt_part(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q, context_lens, block_tables) of the sequences after the decodes, built once a
        step for every layer's attention. Behind decodes they are copies, not views: a view starts at
        an address that is 16-byte aligned only when num_decodes is a multiple of 4, and Triton
        compiles a kernel per pointer alignment, so a view would compile a second kernel mid-serving."""
        if self._prompts is None:
            nd = self.num_decodes
            self._prompts = ((self.cu_seqlens_q, self.context_lens, self.block_tables) if nd == 0 else
                             (self.cu_seqlens_q[nd:] - nd, self.context_lens[nd:].clone(), self.block_tables[nd:].clone()))
        return self._prompts

    def fresh_plan(self, min_len: int) -> "FreshPlan":
        """Which prompts of the step go to SDPA (fresh, at least min_len tokens; 0: none), built once
        a step for every layer from the host's lists (no device read)."""
        plan = self._fresh.get(min_len)
        if plan is None:
            plan = self._fresh[min_len] = FreshPlan.build(self, min_len)
        return plan


# Fresh prompts of at least this many tokens attend through torch's SDPA, shorter ones and every
# other sequence through our kernel. Measured (H100, llama-3-8b TP=1, fraction of the same run's
# matmul peak; bench/notes/attention.md run 4): SDPA's own choice (cuDNN's sm90 flash kernel) is
# 0.80 / 0.74 / 0.50 at 1x8192 / 4x2048 / 16x512 against our kernel's 0.54 / 0.47 / 0.30, but the
# engine pays ~80 us per 8192 tokens on top (the gathers of k/v and the copy into `out`: SDPA has no
# out=), and each SDPA call ~150-200 us of host time. Through this dispatch: 0.74 / 0.57 at 1x8192 /
# 4x2048 (wins), 0.275 at 16x512 (loses to the kernel's 0.30), and on a lognormal mix of 24 prompts
# (median 256) any threshold under the longest prompt lost to the kernel alone (0.29): 512 gave 0.05,
# 1024 0.14 (one call per prompt of its own length, host-bound). So 2048: every measured win is at
# 2048 tokens or more, and a layer makes at most max_num_batched_tokens / 2048 SDPA calls.
SDPA_MIN_LEN = 2048
# 16-bit only: float32 has no flash/cuDNN backend with GQA and would fall back to the math
# backend, which holds heads x L x L float32 scores (8 GiB at 8192 tokens and 32 heads).
SDPA_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class FreshPlan:
    """The step's prompts that SDPA attends to, as runs of adjacent prompts of equal length (one call
    each: a run of B prompts of L tokens is a free [B, L, heads, D] view of the packed rows), the
    step rows [span) whose keys are gathered for them, and the longest chunk left to our kernel
    (0: none). The kernel skips the SDPA prompts on the device by the same rule (fresh_from)."""
    min_len: int
    runs: list[tuple[int, int, int]]     # (first step row, prompts, tokens per prompt)
    span: tuple[int, int]
    kernel_max_q_len: int

    @staticmethod
    def build(meta: AttnMeta, min_len: int) -> "FreshPlan":
        nd = meta.num_decodes
        q_lens, ctx = meta.q_lens_list, meta.context_lens_list
        if q_lens is None or ctx is None:   # no host copy: every prompt to the kernel
            return FreshPlan(0, [], (0, 0), meta.max_q_len)
        runs, kernel_max, row = [], 0, nd
        for ql, cl in zip(q_lens[nd:], ctx[nd:]):
            if min_len and ql == cl and ql >= min_len:
                if runs and runs[-1][2] == ql and runs[-1][0] + runs[-1][1] * ql == row:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1, ql)
                else:
                    runs.append((row, 1, ql))
            else:
                kernel_max = max(kernel_max, ql)
            row += ql
        span = (runs[0][0], runs[-1][0] + runs[-1][1] * runs[-1][2]) if runs else (0, 0)
        return FreshPlan(min_len, runs, span, kernel_max)


def sdpa_fresh(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               plan: FreshPlan, scale: float, out: torch.Tensor) -> None:
    """The plan's fresh prompts: keys and values of the step rows [span) gathered from the cache
    (written there before attention; the step's own k/v live in the piecewise graphs' pool), then one
    causal SDPA call per run, torch choosing the backend (cuDNN on H100; flash/AOTriton on ROCm), and
    the copy into `out` (a static buffer the next graph segment reads)."""
    a, b = plan.span
    h, hkv = q.shape[1], k_cache.shape[2]
    slots = slot_mapping[a:b]
    k = k_cache.flatten(0, 1).index_select(0, slots)
    v = v_cache.flatten(0, 1).index_select(0, slots)
    for row, n, ln in plan.runs:
        rows = slice(row, row + n * ln)
        kv = slice(row - a, row - a + n * ln)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[rows].unflatten(0, (n, ln)).transpose(1, 2), k[kv].unflatten(0, (n, ln)).transpose(1, 2),
            v[kv].unflatten(0, (n, ln)).transpose(1, 2), is_causal=True, scale=scale, enable_gqa=hkv != h)
        out[rows].unflatten(0, (n, ln)).copy_(o.transpose(1, 2))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # index_copy_ keeps the write a single capturable op for CUDA graphs.
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Lq, H, D], k/v [B, Lk, Hkv, D], mask [B, Lq, Lk] (True = visible) -> [B, Lq, H, D]."""
    b, lq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qf = q.float().view(b, lq, hkv, g, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.float())
    return o.reshape(b, lq, h, d).to(q.dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """[B, n_blocks] block ids -> [B, n_blocks * block_size, Hkv, D] contiguous history."""
    x = cache[block_table[:, :n_blocks].long()]
    b, nb, bs, h, d = x.shape
    return x.reshape(b, nb * bs, h, d)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttnMeta, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; causal within each sequence, keys from the paged cache."""
    out = torch.empty_like(q) if out is None else out
    bs = k_cache.shape[1]
    q_lens = meta.q_lens_list if meta.q_lens_list is not None else meta.cu_seqlens_q.diff().tolist()
    ctx = meta.context_lens_list if meta.context_lens_list is not None else meta.context_lens.tolist()
    nd = meta.num_decodes
    if nd:
        n_blocks = -(-max(ctx[:nd]) // bs)
        k = _gather_kv(k_cache, meta.block_tables[:nd], n_blocks)
        v = _gather_kv(v_cache, meta.block_tables[:nd], n_blocks)
        lens = meta.context_lens[:nd].to(q.device).long()
        mask = (torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None])[:, None, :]
        out[:nd] = _attend(q[:nd, None], k, v, mask, scale)[:, 0]
    start = nd
    for s in range(nd, len(q_lens)):
        ql, cl = q_lens[s], ctx[s]
        n_blocks = -(-cl // bs)
        k = _gather_kv(k_cache, meta.block_tables[s:s + 1], n_blocks)[:, :cl]
        v = _gather_kv(v_cache, meta.block_tables[s:s + 1], n_blocks)[:, :cl]
        # Query i sits at absolute position cl - ql + i and may see keys up to that position.
        qpos = torch.arange(cl - ql, cl, device=q.device)
        mask = (torch.arange(cl, device=q.device)[None, :] <= qpos[:, None])[None]
        out[start:start + ql] = _attend(q[None, start:start + ql], k, v, mask, scale)[0]
        start += ql
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttnMeta, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], into `out` when given (a CUDA graph's static input that the next
    graph piece reads: serving/worker/piecewise.py)."""
    if not meta.use_triton:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, out)
    from tp_overlap_plugin.kernels.attention import paged_decode_attention, paged_prefill_attention
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decodes
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, meta.context_lens[:nd], meta.block_tables[:nd],
                               scale, out=out[:nd])
    if meta.cu_seqlens_q.numel() - 1 > nd:
        plan = meta.fresh_plan(SDPA_MIN_LEN if q.dtype in SDPA_DTYPES else 0)
        if plan.kernel_max_q_len:
            cu, ctx, tables = meta.prompt_part()
            paged_prefill_attention(q[nd:], k_cache, v_cache, cu, ctx, tables, plan.kernel_max_q_len, scale,
                                    out=out[nd:], fresh_from=plan.min_len)
        if plan.runs:
            sdpa_fresh(q, k_cache, v_cache, meta.slot_mapping, plan, scale, out)
    return out
