"""The overlap factory: the same four TP modules as `layers.TPLayers`, the same weight tensors, but
communication through the symmetric heap.

Per step (decided by the embedding, the first module of every step) the residual stream is either
  * sequence-parallel: T is padded to a multiple of W and each rank holds T/W rows. Column layers
    all-gather their input while they multiply (AG-GEMM), row layers multiply and reduce-scatter
    (GEMM-RS), the embedding reduce-scatters its partial lookups, the LM head gathers once; or
  * replicated (small T, decode): vLLM's layout, with row layers reduced by our IPC all-reduce;
    a row layer whose output goes straight into the next RMSNorm (the model builds o_proj and
    down_proj so) hands that norm a PendingAllReduce, and the all-reduce, the residual add and the
    norm run as one kernel (HeapAllReduceNorm). Or a row layer runs as one GEMM + all-reduce
    kernel (GemmAllReduce) whose output the norm then adds and normalises itself.
Which, and whether each op takes the fused kernel or the sequential NCCL + GEMM pair, is the
dispatcher's call (dispatch.py: measured tables, stock where unmeasured; the rank's OverlapPlan holds
it, with the design whose AG-GEMM / GEMM-RS classes the layers build), per step size within the
engine's verdict (Dispatcher.step_runs, from tune's whole-step check): a step size where the flag's
step lost to the stock engine's runs the replicated layout, or every op stock; the fused all-reduce +
norm runs where the dispatcher picks our all-reduce, GEMM + all-reduce where the dispatcher's
gemm_all_reduce rows say it beats both. In the replicated layout every local matmul (column, row,
LM head) goes through `OverlapTPLayers.linear`: our decode matmul (ops.gemv, 1-64 rows) where the
table's gemv rows say it streams the weight faster than cuBLAS, F.linear elsewhere. At TP=1 there is
no heap and no communication: the flag's layers are those local matmuls alone.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.layers import (ColumnParallelLinear, ParallelLMHead, PendingAllReduce, RowParallelLinear,
                                      TPGroup, TPLayers, VocabParallelEmbedding, activate_silu_mul)
from tp_overlap_plugin.ops.gemm import gemm_silu_mul, gemm_silu_mul_applies
from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
from tp_overlap_plugin.ops.gemv import gemv, gemv_applies, gemv_silu_mul, gemv_silu_mul_applies
from tp_overlap_plugin.ops.operands import KERNEL_DTYPES
from tp_overlap_plugin.overlap_plan import OverlapPlan

STOCK = Dispatcher(mode="stock")  # the ops of a step that the engine's verdict runs stock
# The fused all-reduce + norm takes steps of up to this many bytes of rows (decode batches): its
# receive slots take 2 * W times as much heap.
FUSED_NORM_BYTES = 1 << 20
# GEMM + all-reduce takes steps of up to this many tokens (decode batches, where the GEMM streams the
# weight): its receive slots take 2 * W * rows * hidden elements of heap.
GEMM_AR_ROWS = 64


def fused_norm_rows(hidden: int, max_tokens: int, dtype: torch.dtype) -> int:
    return max(1, min(max_tokens, FUSED_NORM_BYTES // (hidden * torch.empty((), dtype=dtype).element_size())))


def gemm_ar_rows(max_tokens: int) -> int:
    return max(1, min(max_tokens, GEMM_AR_ROWS))


def warm_up_token_counts(max_tokens: int, world: int, buckets=()) -> list[int]:
    """Step sizes (tokens) whose forwards, run once each before serving, compile every variant of the
    kernels that wait on peers which a step of up to `max_tokens` can hit. A variant first compiled
    mid-serving holds its rank for the compile while its peers wait: bounded by heap_timeout_s, but
    no step should rely on that. An op's variant is fixed by its tile config, per M bucket of the
    GEMM table (`buckets`, and gemm_config.SMALL_M without a table), and by Triton's specialisation
    of its row count (1, a multiple of 16, or neither). So per interval between bucket edges: one row
    count of each class, for a shard's rows (sequence-parallel ops split a step by rows across the
    world) and for a whole step's (the replicated layout's ops)."""
    from tp_overlap_plugin.gemm_config import SMALL_M
    edges = sorted({0, SMALL_M, *buckets})

    def rows_up_to(limit: int) -> set[int]:
        rows = {1}
        for lo, hi in zip(edges, edges[1:] + [limit]):
            hi = min(hi, limit)
            sixteen = (lo // 16 + 1) * 16
            other = lo + 1 if (lo + 1) % 16 else lo + 2
            rows.update(r for r in (sixteen, other) if r <= hi)
        return rows

    shard = {min(r * world, max_tokens) for r in rows_up_to(-(-max_tokens // world))}
    return sorted(shard | rows_up_to(max_tokens))


def required_heap_bytes(plan: OverlapPlan, hidden: int, max_tokens: int, dtype: torch.dtype) -> int:
    """Heap for one model: the plan's AG-GEMM's and GEMM-RS's receive slots of T/W rows of the hidden
    size (every column layer reads, and every row layer writes, the hidden size; one op of each serves
    all layers), the all-reduce's (up to the plan's capacity), the fused all-reduce + norm's and GEMM +
    all-reduce's receive slots (row layers output the hidden size: one op of each), flags."""
    world = plan.world
    rows = -(-max_tokens // world)
    return (plan.ag_gemm.heap_bytes(world, rows, hidden, dtype) + plan.gemm_rs.heap_bytes(world, rows, hidden, dtype)
            + HeapAllReduce.heap_bytes(world, plan.max_bytes)
            + HeapAllReduceNorm.heap_bytes(world, hidden, fused_norm_rows(hidden, max_tokens, dtype), dtype)
            + GemmAllReduce.heap_bytes(world, gemm_ar_rows(max_tokens), hidden, dtype) + (16 << 20))


class OverlapTPLayers(TPLayers):
    name = "overlap"

    def __init__(self, tp: TPGroup, dtype: torch.dtype, device, heap: Optional[SymmetricHeap], max_tokens: int,
                 plan: OverlapPlan):
        """`heap` is None only at TP=1: nothing is communicated, and the layers are the local matmuls
        (the decode matmul where the table picks it). `plan`: the rank's table, the design whose AG-GEMM
        and GEMM-RS the sharded layout runs, and the all-reduce's capacity (larger messages take the
        stock all-reduce)."""
        super().__init__(tp, dtype, device)
        if heap is None and tp.world_size > 1:
            raise ValueError(f"the overlap layers at TP={tp.world_size} need a symmetric heap")
        if heap is not None and heap.world_size != tp.world_size:
            raise ValueError(f"heap spans {heap.world_size} ranks, the TP group {tp.world_size}")
        if plan.world != tp.world_size:
            raise ValueError(f"the plan is for TP={plan.world}, the TP group has {tp.world_size} ranks")
        self.heap = heap
        self.plan = plan
        self.max_tokens = max_tokens
        self.max_rows = -(-max_tokens // tp.world_size)
        self.dispatcher = plan.dispatcher
        self.step_dispatcher = self.dispatcher  # the current step's: the table's, or STOCK by the verdict
        # the plan's AG-GEMM per input size ("ag", k) and GEMM-RS per output size ("rs", n)
        self._fused: dict[tuple[str, int], object] = {}
        self._ops: set[tuple[str, int, int]] = set()  # (op, K, N) of every linear layer built
        self.all_reduce = (HeapAllReduce(heap, plan.max_bytes, device_group=tp.group,
                                         auto_one_shot_bytes=self.dispatcher.one_shot_max_bytes)
                           if heap is not None else None)
        self._norms: dict[int, HeapAllReduceNorm] = {}  # the fused all-reduce + norm, per hidden size
        self._gemm_ar: dict[int, GemmAllReduce] = {}  # GEMM + all-reduce, per output size
        self.tokens = 0              # T of the current step
        self.padded = 0              # T rounded up to a multiple of W
        self.sequence_parallel = False

    # Heap-backed ops are collective to build: every rank builds the same model in the same order,
    # so creating them as modules are constructed keeps the heap symmetric.
    def column_op(self, k: int, n: int):
        """The plan's AG-GEMM for a column layer of input size k and n local output columns (None at TP=1)."""
        return self._fused_op("ag", k, n, k, self.plan.ag_gemm)

    def rs_op(self, k: int, n: int):
        """The plan's GEMM-RS for a row layer of k local input rows and n output columns (None at TP=1)."""
        return self._fused_op("rs", k, n, n, self.plan.gemm_rs)

    def _fused_op(self, kind: str, k: int, n: int, width: int, cls):
        """One op per (kind, width) on the heap, shared by the layers of that width."""
        self._ops.add((kind, k, n))
        if self.heap is None:
            return None
        if (kind, width) not in self._fused:
            self._fused[(kind, width)] = cls(self.heap, self.max_rows, width, self.dtype, device_group=self.tp.group)
        return self._fused[(kind, width)]

    def norm_op(self, hidden: int) -> HeapAllReduceNorm:
        """The fused all-reduce + residual add + RMSNorm for rows of `hidden` (built with the first
        row layer that feeds a norm, collectively like the other heap ops)."""
        if hidden not in self._norms:
            self._norms[hidden] = HeapAllReduceNorm(self.heap, hidden,
                                                    fused_norm_rows(hidden, self.max_tokens, self.dtype), self.dtype)
        return self._norms[hidden]

    def gemm_ar_op(self, n: int) -> GemmAllReduce:
        """GEMM + all-reduce for row layers of n outputs (built with the first such layer)."""
        if n not in self._gemm_ar:
            self._gemm_ar[n] = GemmAllReduce(self.heap, gemm_ar_rows(self.max_tokens), n, self.dtype)
        return self._gemm_ar[n]

    def graph_step(self, tokens: int) -> bool:
        """Whether a step of `tokens` above the default graph size runs in a piecewise graph: the plan's
        answer for the linear ops built (OverlapPlan.graph_step)."""
        return self.plan.graph_step(tokens, self._ops)

    def begin_step(self, tokens: int) -> None:
        if tokens > self.max_tokens:
            raise ValueError(f"step has {tokens} tokens, the overlap layers were sized for {self.max_tokens} "
                             f"(max_num_batched_tokens)")
        w = self.tp.world_size
        self.tokens = tokens
        self.padded = -(-tokens // w) * w
        runs = self.dispatcher.step_runs(tokens, tuple(sorted(self._ops)))
        self.step_dispatcher = STOCK if runs == "stock" else self.dispatcher
        self.sequence_parallel = (w > 1 and runs == "flag"
                                  and self.dispatcher.sequence_parallel(self.padded, self._ops))
        stats.record("layers.sequence_parallel_steps" if self.sequence_parallel else "layers.replicated_steps")
        if runs != "flag":
            stats.record(f"layers.{runs}_steps_by_verdict")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear on this rank's weight, or our decode matmul where the table says it streams the
        weight faster (decode-sized x: ops.gemv)."""
        if self.takes_gemv(x, weight):
            return gemv(x, weight, bias)
        return nn.functional.linear(x, weight, bias)

    def takes_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return gemv_applies(x, weight) and self.step_dispatcher.gemv(x.shape[0], weight.shape[1], weight.shape[0])

    def embedding(self, vocab_size: int, hidden: int) -> "OverlapEmbedding":
        return OverlapEmbedding(self, vocab_size, hidden)

    def column(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> "OverlapColumn":
        return OverlapColumn(self, input_size, output_sizes, bias)

    def row(self, input_size: int, output_size: int, bias: bool = False,
            reduce_into_norm: bool = False) -> "OverlapRow":
        return OverlapRow(self, input_size, output_size, bias, reduce_into_norm)

    def lm_head(self, vocab_size: int, hidden: int, tied_to=None) -> "OverlapLMHead":
        return OverlapLMHead(self, vocab_size, hidden, tied_to)


class OverlapEmbedding(VocabParallelEmbedding):
    def __init__(self, layers: OverlapTPLayers, vocab_size: int, hidden: int):
        super().__init__(layers.tp, vocab_size, hidden, layers.dtype, layers.device)
        self.layers = layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        L = self.layers
        L.begin_step(ids.shape[0])
        if not L.sequence_parallel:
            return super().forward(ids)
        padded = torch.cat([ids, ids.new_zeros(L.padded - L.tokens)]) if L.padded > L.tokens else ids
        return runtime.reduce_scatter(self.local_lookup(padded), self.tp.group)


class OverlapColumn(ColumnParallelLinear):
    def __init__(self, layers: OverlapTPLayers, input_size: int, output_sizes: Sequence[int], bias: bool):
        super().__init__(layers.tp, input_size, output_sizes, bias, layers.dtype, layers.device)
        self.layers = layers
        self.ag = layers.column_op(input_size, self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = self.layers
        if not L.sequence_parallel:
            return L.linear(x, self.weight, self.bias)
        w = self.weight.t()  # a view: the kernel takes any B strides, so no weight copy
        y = self.ag(x, w)[:L.tokens] if self._ag_gemm(w) else self._gathered(x) @ w
        return y + self.bias if self.bias is not None else y

    def _ag_gemm(self, w: torch.Tensor) -> bool:
        L = self.layers
        return L.step_dispatcher.fused_gemm("ag", L.padded, self.input_size, w.shape[1])

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """The sequential AG path's input: every rank's rows of the step."""
        stats.record("ag_gemm.sequential")
        return runtime.all_gather(x, self.tp.group)[:self.layers.tokens]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """gate_up_proj and its SiLU-mul, as one launch where the table measured that faster at this M
        than the matmul and then the SiLU-mul kernel (tune's phase silu_mul): the decode matmul's FMA
        path with the activation in its epilogue (ops.gemv.gemv_silu_mul) where the layer's x is
        decode-sized and the table picks that path; our GEMM with it in its epilogue (ops.gemm.gemm_silu_mul)
        where the layer's matmul is a plain GEMM (the replicated layout, TP=1 included, or the
        sequential AG path's gathered rows). Either way the [T, 2I] product never reaches memory.
        AG-GEMM and the decode matmul's tensor-core path keep their plain stores: the matmul, then the kernel."""
        L = self.layers
        w = self.weight.t()
        if self.bias is not None or len(self.local_sizes) != 2 or self.local_sizes[0] != self.local_sizes[1]:
            return super().silu_mul(x)  # (which refuses a layer that is not [gate; up])
        if L.sequence_parallel and not self._ag_gemm(w):
            x = self._gathered(x)
            fuses = self._fuses(x, gemm_silu_mul_applies(x, w))
            return self._gemm_silu_mul(x, w) if fuses else activate_silu_mul(x @ w)
        if not L.sequence_parallel and gemv_silu_mul_applies(x, self.weight):
            return gemv_silu_mul(x, self.weight) if self._fuses(x, True) else super().silu_mul(x)
        if not L.sequence_parallel and not L.takes_gemv(x, self.weight) and self._fuses(x, gemm_silu_mul_applies(x, w)):
            return self._gemm_silu_mul(x, w)
        return super().silu_mul(x)

    def _fuses(self, x: torch.Tensor, applies: bool) -> bool:
        return applies and self.layers.step_dispatcher.gemm_silu_mul(x.shape[0], self.input_size, self.weight.shape[0])

    @staticmethod
    def _gemm_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        stats.record("gemm_silu_mul.kernel")
        return gemm_silu_mul(x, w)


class OverlapRow(RowParallelLinear):
    def __init__(self, layers: OverlapTPLayers, input_size: int, output_size: int, bias: bool,
                 reduce_into_norm: bool = False):
        super().__init__(layers.tp, input_size, output_size, bias, layers.dtype, layers.device)
        self.layers = layers
        self.rs = layers.rs_op(self.weight.shape[1], output_size)
        self.norm_op = layers.norm_op(output_size) if reduce_into_norm and layers.tp.world_size > 1 else None
        self.gemm_ar = (layers.gemm_ar_op(output_size)
                        if layers.tp.world_size > 1 and layers.dtype in KERNEL_DTYPES else None)

    def _reduce_add_rmsnorm(self, partial, residual, weight, eps):
        return self.norm_op(partial, residual, weight, eps, bias=self.bias)

    def forward(self, x: torch.Tensor) -> "torch.Tensor | PendingAllReduce":
        L = self.layers
        w = self.weight.t()
        if L.sequence_parallel:
            if L.padded > L.tokens:
                x = torch.cat([x, x.new_zeros(L.padded - L.tokens, x.shape[1])])
            if L.step_dispatcher.fused_gemm("rs", L.padded, w.shape[0], self.output_size):
                y = self.rs(x, w)
            else:
                stats.record("gemm_rs.sequential")
                y = runtime.reduce_scatter(x @ w, self.tp.group)
        else:
            in_graph = runtime.capturing(x.device)
            if (self.gemm_ar is not None and self.gemm_ar.applies(x, self.weight)
                    and L.step_dispatcher.gemm_all_reduce(x.shape[0], self.weight.shape[1], self.output_size,
                                                     in_graph, into_norm=self.norm_op is not None)):
                # the bias goes in after the sum, inside the kernel; the norm (if any) adds the residual
                return self.gemm_ar(x, self.weight, bias=self.bias)
            y = L.linear(x, self.weight)
            # a message our all-reduce cannot take goes to the stock all-reduce in place: through
            # HeapAllReduce's own fallback it would cost a copy of every such message (at TP=2 an
            # 8192-token prefill step paid 2.7 ms for them, the flag's whole loss there; the table's
            # rows say ipc above their largest size, which the op's capacity does not reach)
            if (self.tp.world_size > 1 and L.all_reduce.kernel_applies(y)
                    and L.step_dispatcher.ipc_all_reduce(y.numel() * y.element_size(), in_graph)):
                if (self.norm_op is not None and self.norm_op.applies(y)
                        and L.step_dispatcher.fused_norm(self.output_size, y.shape[0], in_graph)):
                    # the bias goes in after the sum, inside the fused kernel
                    return PendingAllReduce(y, self._reduce_add_rmsnorm)
                y = L.all_reduce(y)
            else:
                self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class OverlapLMHead(ParallelLMHead):
    def __init__(self, layers: OverlapTPLayers, vocab_size: int, hidden: int, tied_to):
        super().__init__(layers.tp, vocab_size, hidden, layers.dtype, layers.device, tied_to)
        self.layers = layers

    def token_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        L = self.layers
        if L.sequence_parallel:
            return runtime.all_gather(hidden, self.tp.group)[:L.tokens]
        return hidden

    def local_logits(self, picked: torch.Tensor) -> torch.Tensor:
        return self.layers.linear(picked, self.weight)
