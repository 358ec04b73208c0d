"""Tensor-parallel layers: the one interface the model files are written against.

The model code never calls torch.distributed itself. It asks a *layer factory* (`TPLayers`) for
four kinds of module and composes every decoder layer as

    norm -> column layer -> attention / activation -> row layer -> residual add

The factory decides where communication happens and how the residual stream is laid out.

Residual layout
---------------
Every tensor the model passes between "row layer output" and "column layer input" is in the
factory's *residual layout*; the model only applies token-wise operations to it (RMSNorm, add), so it
never needs to know which layout that is.

* Stock (`TPLayers` itself, this file): the residual holds all T tokens on every rank, replicated.
* Sequence-parallel (the overlap path, added by another module): the residual holds T/W rows per rank.
  Column layers then all-gather their input while they multiply (AG-GEMM), row layers reduce-scatter
  their output (GEMM-RS), the embedding reduce-scatters, and the LM head gathers once.

Module contracts (T = tokens in the step, W = world size, r = rank)
-------------------------------------------------------------------
embedding(vocab_size, hidden)            ids [T] -> residual layout [T_local, hidden]
column(input_size, output_sizes, bias)   residual layout [T_local, input] -> [T, sum(output_sizes) / W]
                                         (all tokens, this rank's columns of every sub-matrix); a
                                         column layer of two equal sub-matrices (gate, up) also has
                                         silu_mul(x) -> silu(gate) * up [T, output_sizes[0] / W],
                                         which a factory may compute in the GEMM's epilogue
row(input_size, output_size, bias,      [T, input / W] -> residual layout [T_local, output]; with
    reduce_into_norm)                    reduce_into_norm=True the caller promises to pass the output
                                         straight to an RMSNorm with the residual, and the factory may
                                         hand back a PendingAllReduce instead (see below)
lm_head(vocab_size, hidden, tied_to)     (residual layout, rows: LongTensor of token indices in [0, T), or
                                         None for all T) -> logits [len(rows), vocab_size], full vocabulary,
                                         every rank; in two parts: token_rows(residual layout) ->
                                         [T, hidden] (the step's layout only), then logits(that, rows)

A row layer's all-reduce and the residual add + RMSNorm after it can be one kernel. A factory that
has one returns, from a row layer built with reduce_into_norm=True, a `PendingAllReduce` (the
partial sums and how to finish them) instead of the reduced rows; the model's RMSNorm passes it
its residual, weight and eps (`add_rmsnorm`) and gets (normed, new residual) back, as it would
have computed from reduced rows. Nothing else accepts one.

A factory may keep per-step state in itself (for example T as seen by the embedding, or padding of T
to a multiple of W); all modules of one model share one factory instance, and the embedding is always
the first module called in a step.

Weights
-------
Weights are plain `nn.Parameter`s holding this rank's shard, in the same shapes for every factory, so
an implementation swaps forwards and never re-shards:

* column: weight [sum(output_sizes) / W, input_size], rows = concat over sub-matrices of this rank's
  contiguous slice (e.g. QKV = [q_r; k_r; v_r]); bias likewise.
* row: weight [output_size, input_size / W], this rank's contiguous input columns; bias replicated,
  added once after the reduction.
* vocab embedding / LM head: weight [ceil(V / W), hidden], rows r*ceil(V/W) ... (zero-padded past V).

Each module has `load_shard(loaded, shard_id=None)`, which accepts either a tensor of the full
(unsharded) checkpoint tensor or a lazily sliceable object (a safetensors slice), so each rank reads
only its own bytes from disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tp_overlap_plugin import runtime
from tp_overlap_plugin.kernels import layer_ops


@dataclass
class TPGroup:
    """The tensor-parallel group a model is built for. `group` is None only when world_size == 1."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.world_size == 1 else runtime.all_gather(x, self.group, dim)


@dataclass
class PendingAllReduce:
    """A row layer's partial output whose all-reduce is left to the RMSNorm that follows, to be done
    in one kernel with the residual add and the norm. `finish(partial, residual, weight, eps)` returns
    (normed, new residual)."""

    partial: torch.Tensor
    finish: Any

    def add_rmsnorm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        return self.finish(self.partial, residual, weight, eps)


def _divide(n: int, w: int, what: str) -> int:
    if n % w != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({w})")
    return n // w


def _shape_of(loaded) -> tuple[int, ...]:
    # safetensors slices expose get_shape(); tensors expose shape.
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def _copy_into(dst: torch.Tensor, src) -> None:
    src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shard shape {tuple(src.shape)} does not match parameter shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows; several sub-matrices may be merged (QKV, gate_up)."""

    def __init__(self, tp: TPGroup, input_size: int, output_sizes: Sequence[int], bias: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [_divide(n, tp.world_size, "column-parallel output size") for n in output_sizes]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def _target(self, param: torch.Tensor, shard_id: int | None) -> tuple[torch.Tensor, int]:
        sid = 0 if shard_id is None else shard_id
        off = sum(self.local_sizes[:sid])
        n = self.local_sizes[sid]
        return param.narrow(0, off, n), n

    def load_shard(self, loaded, shard_id: int | None = None, *, is_bias: bool = False) -> None:
        param = self.bias if is_bias else self.weight
        if param is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        dst, n = self._target(param, shard_id)
        expect = self.output_sizes[0 if shard_id is None else shard_id]
        if _shape_of(loaded)[0] != expect:
            raise ValueError(f"checkpoint tensor has {_shape_of(loaded)[0]} rows, expected {expect}")
        r = self.tp.rank
        _copy_into(dst, loaded[r * n:(r + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a layer built from two equal sub-matrices [gate; up] (gate_up_proj):
        the layer's output, then the activation (layer_ops' kernel on a GPU)."""
        if len(self.local_sizes) != 2 or self.local_sizes[0] != self.local_sizes[1]:
            raise ValueError(f"silu_mul needs a column layer of two equal sub-matrices (gate, up), this one has "
                             f"{self.output_sizes}")
        return activate_silu_mul(self.forward(x))


def activate_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (gate | up) -> silu(gate) * up [T, n]: one kernel on a GPU, torch (HF's order) on the CPU."""
    if gate_up.device.type != "cpu":
        return layer_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) (+ b) with W split by input columns."""

    def __init__(self, tp: TPGroup, input_size: int, output_size: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.local_input = _divide(input_size, tp.world_size, "row-parallel input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def load_shard(self, loaded, shard_id: int | None = None, *, is_bias: bool = False) -> None:
        if is_bias:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _copy_into(self.bias, loaded[:])
            return
        n, r = self.local_input, self.tp.rank
        if _shape_of(loaded)[1] != self.input_size:
            raise ValueError(f"checkpoint tensor has {_shape_of(loaded)[1]} columns, expected {self.input_size}")
        _copy_into(self.weight, loaded[:, r * n:(r + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(nn.functional.linear(x, self.weight))
        # Adding the bias after the reduction keeps it from being counted W times.
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding split by vocabulary; each rank looks up the ids it owns, the rest are zero."""

    def __init__(self, tp: TPGroup, vocab_size: int, hidden: int, dtype: torch.dtype, device):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = math.ceil(vocab_size / tp.world_size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def load_shard(self, loaded, shard_id: int | None = None, *, is_bias: bool = False) -> None:
        if _shape_of(loaded)[0] != self.vocab_size:
            raise ValueError(f"checkpoint embedding has {_shape_of(loaded)[0]} rows, expected {self.vocab_size}")
        end = min(self.start + self.per_rank, self.vocab_size)
        with torch.no_grad():
            self.weight.zero_()
        if end > self.start:
            _copy_into(self.weight[: end - self.start], loaded[self.start:end])

    def local_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        own = (local >= 0) & (local < self.per_rank)
        out = nn.functional.embedding(torch.where(own, local, 0), self.weight)
        return out * own.unsqueeze(-1).to(out.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.local_lookup(ids))


class ParallelLMHead(nn.Module):
    """Logits for selected token rows; each rank multiplies by its vocab rows, then the pieces are gathered."""

    def __init__(self, tp: TPGroup, vocab_size: int, hidden: int, dtype: torch.dtype, device,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        if tied_to is not None:
            # Shares the Parameter object, so a later loaded embedding is the head too.
            self.weight = tied_to.weight
            self.tied = True
        else:
            self.weight = nn.Parameter(torch.zeros(math.ceil(vocab_size / tp.world_size), hidden,
                                                   dtype=dtype, device=device), requires_grad=False)
            self.tied = False

    def load_shard(self, loaded, shard_id: int | None = None, *, is_bias: bool = False) -> None:
        if self.tied:
            return
        per = self.weight.shape[0]
        start = self.tp.rank * per
        end = min(start + per, self.vocab_size)
        with torch.no_grad():
            self.weight.zero_()
        if end > start:
            _copy_into(self.weight[: end - start], loaded[start:end])

    def forward(self, hidden: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        return self.logits(self.token_rows(hidden), rows)

    def token_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual layout's hidden rows -> every token's row on this rank. The stock layout is
        replicated already. Apart from `logits` because it depends on the step's layout, not on the
        rows asked for: a CUDA graph of the step's body may hold it (serving/worker/piecewise.py)."""
        return hidden

    def logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Every token's rows (token_rows) -> the logits of `rows` (all of them for None)."""
        picked = hidden if rows is None else hidden.index_select(0, rows)
        return self.tp.all_gather_cat(self.local_logits(picked), dim=-1)[:, : self.vocab_size]

    def local_logits(self, picked: torch.Tensor) -> torch.Tensor:
        """This rank's vocab columns of the logits."""
        return nn.functional.linear(picked, self.weight)


class TPLayers:
    """The layer factory: the interface every factory keeps, and its stock implementation (column =
    local GEMM, row = local GEMM + all-reduce, vLLM's layout). The overlap factory subclasses it
    (overlap_layers.OverlapTPLayers)."""

    name = "stock"

    def __init__(self, tp: TPGroup, dtype: torch.dtype, device: torch.device | str):
        self.tp = tp
        self.dtype = dtype
        self.device = device

    def embedding(self, vocab_size: int, hidden: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(self.tp, vocab_size, hidden, self.dtype, self.device)

    def column(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> ColumnParallelLinear:
        return ColumnParallelLinear(self.tp, input_size, output_sizes, bias, self.dtype, self.device)

    def row(self, input_size: int, output_size: int, bias: bool = False,
            reduce_into_norm: bool = False) -> RowParallelLinear:
        return RowParallelLinear(self.tp, input_size, output_size, bias, self.dtype, self.device)

    def graph_step(self, tokens: int) -> bool:
        """Whether a step of `tokens` above the engine's default graph size runs in a piecewise graph
        (serving/worker/piecewise.large_buckets): never for the stock layers, which run such steps eagerly."""
        return False

    def lm_head(self, vocab_size: int, hidden: int, tied_to: VocabParallelEmbedding | None = None) -> ParallelLMHead:
        return ParallelLMHead(self.tp, vocab_size, hidden, self.dtype, self.device, tied_to)

