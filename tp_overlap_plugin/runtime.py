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


@functools.lru_cache(maxsize=None)
def warp_size(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).warp_size


def capturing(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


class StreamOrder:
    """Keeps one op's calls in the order the host issues them, whatever streams they are issued on.

    An op keeps its state in device memory (epochs, call counters, receive slots) and each call reads
    and advances it, so its calls must run one after another: two calls running at once on two
    streams would share an epoch, mix their slots, and end in a timeout or a wrong sum. On one stream
    they do. A call on another stream than the op's previous call first makes its stream wait for
    everything queued on the previous one so far (that call included): one event per switch of
    stream, nothing per call beyond looking up the current stream. So micro-batches on two streams,
    or the usual warm-up on a side stream before a graph capture, are correct, and serialised.
    Exempt: the CPU (one stream) and graph capture (torch captures on a stream of its own; a
    replay runs in the order of the stream it is launched on, without calling the op)."""

    def __init__(self):
        self.last: torch.cuda.Stream | None = None
        self.last_handle = None
        self.raw_stream = None

    def before_call(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        if self.raw_stream is None:
            from tp_overlap_plugin.kernels import triton_compat
            self.raw_stream = triton_compat.current_raw_stream()
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        # the common case, the same stream as the last call, costs one handle lookup (eager calls
        # are host-bound)
        handle = self.raw_stream(self.index)
        if handle == self.last_handle or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(device)
        if self.last is not None:
            stream.wait_stream(self.last)
        self.last, self.last_handle = stream, handle


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
    from tp_overlap_plugin.kernels import all_reduce, gemm

    return all(triton_compat.is_interpreted(k) for k in (gemm.gemm_kernel, all_reduce.one_shot_all_reduce_kernel))
