"""What the host ops take from torch's runtime: the device's multiprocessor count (read once), whether
a CUDA graph is being captured, the stock torch.distributed collectives that every path falls
back to (gloo has no reduce-scatter, so that one is an all-reduce and a slice there), and whether
Triton interprets kernels in this process (as kernels on CPU tensors need)."""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def capturing(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


class OneStream:
    """An op whose calls share state in device memory (epochs, call counters, slots) must see its
    calls serialised on one stream: two streams would interleave their loads and stores of that
    state, share an epoch, mix their slots, and end in a timeout or a wrong sum. So each op records
    the stream of its first call and refuses any other. A CUDA graph capture is exempt (torch
    captures on a stream of its own, and a replay runs on the stream it is launched on, without
    calling the op); so is the CPU, which has one stream."""

    def __init__(self, op: str):
        self.op = op
        self.stream: int | None = None

    def check(self, device: torch.device) -> None:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        self.check_id(torch.cuda.current_stream(device).cuda_stream)

    def check_id(self, stream: int) -> None:
        if self.stream is None:
            self.stream = stream
        elif stream != self.stream:
            raise RuntimeError(
                f"{self.op} was called on stream {stream:#x}, but its first call ran on stream {self.stream:#x}: "
                f"an op keeps its epochs and call counters in device memory, so all of its calls must be on one "
                f"stream (build one op per stream, e.g. per micro-batch, for concurrent streams)")


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Rows [r*M/W, (r+1)*M/W) of the sum over ranks, on rank r."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x.chunk(world)[dist.get_rank(group)].clone()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def use_triton_interpreter() -> bool:
    """Whether Triton runs kernels under its interpreter in this process, switching it on if it
    still can. Triton chooses interpreter or compiler as each kernel is defined (its own library
    functions when it is imported), so a process that has imported it without TRITON_INTERPRET=1
    cannot switch any more."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    import triton.language as tl

    from tp_overlap_plugin.kernels import triton_compat

    if not triton_compat.is_interpreted(tl.cdiv):
        return False
    from tp_overlap_plugin.kernels import allreduce, gemm

    return all(triton_compat.is_interpreted(k) for k in (gemm.gemm_kernel, allreduce.one_shot_all_reduce_kernel))
