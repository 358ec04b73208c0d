"""Our all-reduce (one-shot, two-shot) against NCCL/RCCL (gloo on the CPU) and torch's symmetric-memory
all-reduces from 8 KB up, and the decode row layers' epilogue: our fused all-reduce + residual add +
RMSNorm against an all-reduce followed by the add + norm kernel, eager and in CUDA graphs. Runs on
every rank of a run_ranks() context with a heap; each result is rank-local (the caller takes the max
over ranks). Every op is checked against a float32 NCCL reference before it is timed."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm
from tp_overlap_plugin.kernels import layer_ops
from tp_overlap_plugin.tuning.checks import agreed, check_close
from tp_overlap_plugin.tuning.timing import record, repeats_us

SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20, 8 << 20)
EPS = 1e-5


def torch_symm_all_reduce(ctx, max_bytes):
    """torch's own symmetric-memory all-reduces (what vLLM uses on CUDA) as a function of the input
    giving {name: op}, or None where torch has none here (the CPU, ROCm builds without it)."""
    if ctx.device.type != "cuda":
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group_name = ctx.device_group.group_name
        buf = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=ctx.device)
        symm_mem.rendezvous(buf, group_name)
    except Exception as e:
        print(f"rank {ctx.rank}: torch symmetric memory unavailable: {e!r}", file=sys.stderr)
        return None

    def ops(x):
        inp = buf[: x.numel()]
        inp.copy_(x)
        return {"torch_symm_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", group_name),
                "torch_symm_two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", group_name)}
    return ops


def time_ops(ops: dict, row: dict, ctx, *, repeats: int = 1, calls: int = 20, samples: int = 15) -> None:
    """Warm every op on every rank, then time them in interleaved repeats, eager and (GPU) in CUDA
    graphs, into `row` (timing.record)."""
    gpu = ctx.device.type == "cuda"
    for op in ops.values():
        op()
    if gpu:
        torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    record(row, repeats_us(ops, gpu=gpu, graph=False, repeats=repeats, calls=calls, samples=samples,
                           group=ctx.group), "eager")
    if gpu:
        errors: dict = {}
        record(row, repeats_us(ops, gpu=True, graph=True, repeats=repeats, calls=calls, samples=samples,
                               group=ctx.group, errors=errors), "graph")
        row.update({f"{name}_graph_error": e for name, e in errors.items()})


def all_reduce_sweep(ctx, comm: HeapAllReduce, symm, sizes, *, repeats: int = 1, samples: int = 15,
                     on_row=None) -> list[dict]:
    """Per message size: ours one-shot (up to its capacity) and two-shot, each checked first, NCCL,
    and torch's where present."""
    dtype = torch.bfloat16
    rows = []
    for nbytes in sizes:
        numel = nbytes // 2
        x = torch.randn(numel, dtype=dtype, device=ctx.device)
        y = torch.empty_like(x)
        nccl_buf = x.clone()
        ref = x.float().clone()
        dist.all_reduce(ref, group=ctx.device_group)
        row = {"bytes": nbytes}
        algorithms = ("one_shot", "two_shot") if nbytes <= comm.one_shot_bytes else ("two_shot",)
        if "one_shot" not in algorithms:
            row["ours_one_shot_error"] = f"over one_shot_max_bytes={comm.one_shot_bytes}"
        for alg in algorithms:
            y.fill_(float("nan"))
            comm(x, out=y, algorithm=alg)
            row.update(agreed(ctx, lambda alg=alg: check_close(f"{alg}_vs_nccl_fp32", y, ref, ctx.world_size)))
        ops = {f"ours_{alg}": lambda alg=alg: comm(x, out=y, algorithm=alg) for alg in algorithms}
        ops["nccl"] = lambda: dist.all_reduce(nccl_buf, group=ctx.device_group)
        if symm is not None:
            ops.update(symm(x))
        time_ops(ops, row, ctx, repeats=repeats, samples=samples)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def norm_heap_bytes(world: int, hidden: int, max_tokens: int) -> int:
    return (HeapAllReduceNorm.heap_bytes(world, hidden, max_tokens, torch.bfloat16)
            + HeapAllReduce.heap_bytes(world, max_tokens * hidden * 2))


def norm_sweep(ctx, symm, H: int, tokens, *, repeats: int = 1, samples: int = 15, on_row=None) -> list[dict]:
    """The row-layer epilogue of the decode layout, [T, H] bf16: all-reduce of the row layer's
    partial output, + residual, RMSNorm. Fused: one kernel; the others: an all-reduce, then
    layer_ops.rmsnorm (the add + norm kernel the model runs); `ours_alone`: the all-reduce alone."""
    h, dev = ctx.heap, ctx.device
    fused = HeapAllReduceNorm(h, H, max(tokens), torch.bfloat16)
    comm = HeapAllReduce(h, max_bytes=max(tokens) * H * 2)
    weight = (1 + 0.1 * torch.randn(H, device=dev)).to(torch.bfloat16)
    dist.broadcast(weight, 0, group=ctx.device_group)
    rows = []
    for t in tokens:
        x = torch.randn(t, H, dtype=torch.bfloat16, device=dev)
        residual = torch.randn(t, H, dtype=torch.bfloat16, device=ctx.device)
        dist.broadcast(residual, 0, group=ctx.device_group)  # replicated, as in the decode layout
        reduced = x.clone()
        dist.all_reduce(reduced, group=ctx.device_group)
        ref_out, ref_res = layer_ops.rmsnorm(reduced, weight, EPS, residual)
        got_out, got_res = fused(x, residual, weight, EPS)
        row = {"tokens": t, "hidden": H, "bytes": t * H * 2}
        # NCCL sums bf16 in its own order: a few ulps at the outputs' magnitude (checks.py)
        row.update(agreed(ctx, lambda: {**check_close("residual", got_res, ref_res, ctx.world_size),
                                        **check_close("normed", got_out, ref_out, ctx.world_size)}))
        nccl_buf = x.clone()
        y = torch.empty_like(x)
        ops = {"fused": lambda: fused(x, residual, weight, EPS), "ours_alone": lambda: comm(x, out=y),
               "ours_then_norm": lambda: layer_ops.rmsnorm(comm(x, out=y), weight, EPS, residual),
               "nccl_then_norm": lambda: layer_ops.rmsnorm(_nccl(nccl_buf, ctx), weight, EPS, residual)}
        if symm is not None:
            symm_one_shot = symm(x.view(-1))["torch_symm_one_shot"]
            ops["torch_symm_then_norm"] = lambda: layer_ops.rmsnorm(symm_one_shot().view(t, H), weight, EPS, residual)
        time_ops(ops, row, ctx, repeats=repeats, samples=samples)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _nccl(buf, ctx):
    dist.all_reduce(buf, group=ctx.device_group)
    return buf
