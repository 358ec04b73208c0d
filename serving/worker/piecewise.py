"""Piecewise CUDA graphs: every part of a step but attention, replayed from graphs captured per
token-count bucket, for the steps that the whole-step decode graphs do not take (prefill and mixed).

Why: an eager step launches ~a dozen kernels per layer from Python, and a step of a few hundred
tokens is launch-bound (bench/notes/serving.md: a mixed step of ~420 prompt tokens + 127 decodes
took as long on the host as on the GPU). Attention cannot be captured with the rest, because it
depends on per-step host values (the number of decodes, the longest chunk, how tokens split into
sequences); everything else in the model depends only on the token count, so the model's forward is
split at attention (CausalLM.segment / CausalLM.attend) and each segment is a graph per bucket.

A step of n tokens runs in the smallest bucket b >= n: its ids, positions and cache slots are padded
to b (padded rows write their keys and values into the scratch block, which the block manager never
hands out), segment i replays, layer i's attention runs eagerly on the n real rows, reading q from a
static buffer the segment wrote and writing a static buffer that segment i + 1 reads. The padded rows
compute junk nobody reads: every op between attentions is row-independent.

Memory: all graphs (and the decode graphs) share one pool, captured largest bucket first. A
segment's outputs that only the next segment reads (the residual) are referenced from Python only
until that next segment is captured, so later captures reuse their memory; that is safe because
graphs replay in the order they were captured and never at the same time. What Python must reach
at replay lives in static buffers outside the pool (inputs, q, attention output), sized for the
largest bucket.

With the `tp_overlap` flag, each op's path (fused kernel or the NCCL pair, layout, decode matmul) is
the dispatch table's choice for the bucket's token count, taken once at capture; replay costs no
host work over stock. The fused ops count their calls on the device, and every rank replays the
same segments in the same order (rank 0 ships the step, and the bucket follows from its size).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Optional

import torch

from ..model.attention import AttnMeta


# Steps of more tokens run eagerly by default: there the GPU takes longer than the host's launches
# (H100, llama-3-8b: an eager 8192-token step launches in 24 ms and runs 203 ms), so a graph saves
# nothing and its copies cost 0.7% (bench/notes/serving.md section 6).
DEFAULT_MAX_GRAPH_TOKENS = 2048


# Above DEFAULT_MAX_GRAPH_TOKENS, the steps that the flag runs with the chunked fused ops (~20 host operations
# a call: eager, an 8192-token step of Llama-3-8B at TP=4 was host-bound with them, bench/notes/prefill.md
# section 4) run in graphs of buckets every 512 tokens: under 25% padding at 2049 tokens, under 7% from 8192.
LARGE_BUCKET_STEP = 512


def default_token_counts(max_tokens: int, large=()) -> list[int]:
    """Buckets up to min(max_tokens, DEFAULT_MAX_GRAPH_TOKENS): powers of two to 64, then multiples of 64
    to 1024 and of 128 to 2048, and that limit itself; and `large`, the buckets above it (large_buckets).
    Padding a step to a power of two would waste up to half its GEMM time; these keep it under 12.5% from
    64 to 2048 tokens (30 buckets). Below 64 tokens a step is launch-bound, and padding costs little."""
    limit = min(max_tokens, DEFAULT_MAX_GRAPH_TOKENS)
    counts = {c for c in (1, 2, 4, 8, 16, 32, 64) if c <= limit}
    for lo, hi, step in ((64, 1024, 64), (1024, 2048, 128)):
        counts.update(range(lo + step, min(hi, limit) + 1, step))
    counts.add(limit)
    return sorted(counts | {b for b in large if limit < b <= max_tokens})


def large_buckets(max_tokens: int, in_graph) -> list[int]:
    """The buckets above DEFAULT_MAX_GRAPH_TOKENS, every LARGE_BUCKET_STEP tokens and the budget itself,
    whose steps `in_graph(tokens)` says run in graphs: where the flag runs the chunked fused ops sharded
    (the rank's OverlapPlan.graph_step, asked through OverlapTPLayers.graph_step with the model's ops).
    Every other step above the limit runs eagerly, as the stock engine's:
    a step the verdict runs stock must be stock's step (no bucket padding, no graph of stock's ops)."""
    sizes = set(range(DEFAULT_MAX_GRAPH_TOKENS + LARGE_BUCKET_STEP, max_tokens + 1, LARGE_BUCKET_STEP))
    if max_tokens > DEFAULT_MAX_GRAPH_TOKENS:
        sizes.add(max_tokens)
    return sorted(b for b in sizes if in_graph(b))


def check_token_counts(counts: list[int], max_tokens: int) -> None:
    """Bad bucket lists get an error that names the limit."""
    if not counts:
        raise ValueError("piecewise_graph_token_counts is empty; to run without piecewise CUDA graphs set "
                         "piecewise_cuda_graphs=False")
    bad = [c for c in counts if c < 1 or c > max_tokens]
    if bad:
        raise ValueError(f"piecewise_graph_token_counts {bad} outside [1, max_num_batched_tokens={max_tokens}]: "
                         f"a step never holds more than max_num_batched_tokens tokens")


def bucket_for(counts: list[int], n: int) -> Optional[int]:
    """The smallest bucket of `counts` (sorted) holding n tokens, or None when n exceeds them all."""
    i = bisect.bisect_left(counts, n)
    return counts[i] if i < len(counts) else None


class PiecewiseGraphs:
    """The buffers and graphs for every bucket of one model on one rank.

    `capture=False` runs the same segments eagerly over the same padded static buffers (the CPU,
    and tests); `resolve_refs(ids)` replaces in place the ids that stand for tokens sampled by the
    previous step (async scheduling), inside segment 0."""

    def __init__(self, model, kv_caches: list, token_counts: list[int], scratch_slot: int,
                 resolve_refs: Callable[[torch.Tensor], None], capture: bool, pool=None, near_large: bool = False):
        self.model, self.kv_caches = model, kv_caches
        self.counts = sorted(set(token_counts))
        self.near_large = near_large  # the default buckets: a step above the limit takes only its own
        self.scratch_slot = scratch_slot
        self.resolve_refs = resolve_refs
        self.capture = capture
        self.pool = pool
        attn = model.layers[0].self_attn
        weight = model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        mt = self.counts[-1]
        # ids | positions | slots of the step, padded to the bucket: one copy fills them.
        self.inputs = torch.zeros((3, mt), dtype=torch.int64, device=device)
        self.inputs[2].fill_(scratch_slot)
        self.q = torch.zeros((mt, attn.heads, attn.head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((mt, attn.heads * attn.head_dim), dtype=dtype, device=device)
        self.hidden = torch.zeros((mt, model.cfg.hidden_size), dtype=dtype, device=device)  # the final rows
        self.graphs: dict[int, list] = {}   # bucket -> its segments' graphs
        self.capture_s = 0.0
        self.pool_bytes = 0

    def bucket(self, n: int) -> Optional[int]:
        """The bucket a step of n tokens replays, or None (eager). Above DEFAULT_MAX_GRAPH_TOKENS, with the
        default buckets, only a bucket less than LARGE_BUCKET_STEP above n: between large buckets that
        are not contiguous (the verdict runs the sizes between stock) a step runs eagerly, unpadded."""
        b = bucket_for(self.counts, n)
        if (b is not None and self.near_large and b > DEFAULT_MAX_GRAPH_TOKENS
                and b - n >= LARGE_BUCKET_STEP):
            return None
        return b

    def _segment(self, i: int, b: int, residual: Optional[torch.Tensor]):
        """Segment i over the static buffers of bucket b -> the residual for segment i + 1; q goes
        into self.q, the last segment's final hidden rows into self.hidden."""
        ids, positions, slots = self.inputs[0, :b], self.inputs[1, :b], self.inputs[2, :b]
        if i == 0:
            self.resolve_refs(ids)
            x = ids
        else:
            x = self.attn_out[:b]
        out, residual = self.model.segment(i, x, residual, positions, slots, self.kv_caches)
        # Copied out of the segment's own output (for q, a view into qkv), so that no reference held
        # for replay pins pool memory: held, every layer's qkv of every bucket would stay allocated.
        if i == self.model.num_segments - 1:
            self.hidden[:b].copy_(out)
            return None
        self.q[:b].copy_(out)
        return residual

    def _warm_meta(self, b: int) -> AttnMeta:
        """Attention for a warm-up pass: b one-token sequences on the scratch block."""
        dev = self.inputs.device
        return AttnMeta(slot_mapping=self.inputs[2, :b], num_decodes=b,
                        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=dev),
                        context_lens=torch.ones(b, dtype=torch.int32, device=dev),
                        block_tables=torch.full((b, 1), self.scratch_slot // self.kv_caches[0][0].shape[1],
                                                dtype=torch.int32, device=dev),
                        max_q_len=1, q_lens_list=[1] * b, context_lens_list=[1] * b, use_triton=dev.type == "cuda")

    def _eager(self, n: int, b: int, meta: AttnMeta) -> None:
        residual = None
        for i in range(self.model.num_segments - 1):
            residual = self._segment(i, b, residual)
            self.model.attend(i, self.q[:n], meta, self.kv_caches, out=self.attn_out[:n])
        self._segment(self.model.num_segments - 1, b, residual)

    def capture_all(self) -> None:
        """Per bucket, largest first: one eager pass (compiles the kernels for its shapes; on every
        rank alike), then one graph per segment."""
        dev = self.inputs.device
        t0 = time.perf_counter()
        # torch.cuda.graph empties the allocator's cache itself; measured from empty to empty, the
        # growth is the pool's (the eager warm-up passes' blocks go back at the end)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.counts):
                self.inputs[:, :b].copy_(torch.tensor([[0], [0], [self.scratch_slot]], device=dev))
                self._eager(b, b, self._warm_meta(b))
                torch.cuda.synchronize(dev)
                graphs, residual = [], None
                for i in range(self.model.num_segments):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        # the previous residual is dropped once this capture has read it
                        residual = self._segment(i, b, residual)
                    graphs.append(g)
                self.graphs[b] = graphs
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before

    def run(self, n: int, b: int, inputs: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """A step of n tokens in bucket b: inputs [3, b] (ids | positions | slots, padded with the
        scratch slot) -> the final hidden rows of its n tokens."""
        self.inputs[:, :b].copy_(inputs)
        with torch.inference_mode():
            if not self.capture:
                self._eager(n, b, meta)
                return self.hidden[:n]
            graphs = self.graphs[b]
            last = len(graphs) - 1
            for i, g in enumerate(graphs):
                g.replay()
                if i < last:
                    self.model.attend(i, self.q[:n], meta, self.kv_caches, out=self.attn_out[:n])
        return self.hidden[:n]
