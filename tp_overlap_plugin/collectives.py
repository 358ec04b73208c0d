"""Host ops for collectives over the symmetric heap."""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.allreduce import CHUNK_BYTES, one_shot_all_reduce_kernel, two_shot_all_reduce_kernel

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_MAX_BYTES = 8 << 20
ALGORITHMS = ("auto", "one_shot", "two_shot")


def _num_programs(device: torch.device) -> int:
    return 2 * runtime.multiprocessor_count(device) if device.type == "cuda" else 4


class HeapAllReduce:
    """Sum a tensor across the heap's ranks: `out = comm(x)`. Collective: every rank calls it with
    the same shape and dtype, in the same order.

    `algorithm="auto"` takes one-shot, the path measured faster than NCCL in CUDA graphs up to
    2 MB (bench/results/foundation-*); two-shot runs when asked for, or above `two_shot_bytes`.

    Messages the kernel does not cover (another dtype, non-contiguous, over `max_bytes`) go
    through torch.distributed on `device_group` instead; `stats` records which path ran. On the
    CPU the heap's error slot is checked after every call; on a GPU that would cost a device sync
    per call, so callers check `heap.check()` at their own sync points (the engine: once a step).
    """

    def __init__(self, heap: SymmetricHeap, max_bytes: int = DEFAULT_MAX_BYTES,
                 device_group: dist.ProcessGroup | None = None, two_shot_bytes: int | None = None):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.heap = heap
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        self.max_bytes = -(-max_bytes // CHUNK_BYTES) * CHUNK_BYTES
        chunks = self.max_bytes // CHUNK_BYTES
        self.two_shot_bytes = two_shot_bytes
        self.stage = heap.alloc((self.max_bytes,), torch.uint8, name="all_reduce.stage")
        self.result = heap.alloc((self.max_bytes,), torch.uint8, name="all_reduce.result")
        self.ready = heap.alloc((chunks, heap.world_size), torch.int64, name="all_reduce.ready")
        self.done = heap.alloc((chunks, heap.world_size), torch.int64, name="all_reduce.done")
        self.reduced = heap.alloc((chunks,), torch.int64, name="all_reduce.reduced")
        self.epochs = heap.alloc((chunks,), torch.int64, name="all_reduce.epochs")
        for t in (self.ready, self.done, self.reduced, self.epochs):
            t.zero_()
        self.num_programs = _num_programs(heap.device)
        heap.publish()

    def kernel_applies(self, x: torch.Tensor) -> bool:
        return (x.dtype in KERNEL_DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, algorithm: str = "auto") -> torch.Tensor:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"all_reduce algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if x.device != self.heap.device:
            raise ValueError(f"all_reduce input is on {x.device}, but the heap is on {self.heap.device}")
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"all_reduce out must be a contiguous {x.dtype} tensor of shape "
                             f"{tuple(x.shape)} on {x.device}; got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device} (contiguous={out.is_contiguous()})")
        if x.numel() == 0:
            return out
        if not self.kernel_applies(x):
            stats.record("all_reduce.fallback")
            out.copy_(x)
            dist.all_reduce(out, group=self.device_group)
            return out
        nbytes = x.numel() * x.element_size()
        block = CHUNK_BYTES // x.element_size()
        chunks = triton.cdiv(x.numel(), block)
        if algorithm == "auto":
            algorithm = ("two_shot" if self.two_shot_bytes is not None and nbytes >= self.two_shot_bytes
                         else "one_shot")
        if algorithm == "two_shot" and chunks > self.num_programs and self.heap.device.type != "cpu":
            # Two-shot is verified on GPUs only where every program owns one chunk (see
            # bench/notes/allreduce.md: a variant that looped over chunks raced at 8 MB).
            algorithm = "one_shot"
        stats.record(f"all_reduce.{algorithm}")
        grid = (min(chunks, self.num_programs),)
        h = self.heap
        common = dict(rank=h.rank, world=h.world_size, heap_bases=h.heap_bases, error_ptr=h.error,
                      max_spins=h.spin_limit, BLOCK=block, num_warps=4)
        if algorithm == "one_shot":
            one_shot_all_reduce_kernel[grid](x, out, self.stage.view(x.dtype), self.ready, self.done,
                                             self.epochs, x.numel(), **common)
        else:
            two_shot_all_reduce_kernel[grid](x, out, self.stage.view(x.dtype), self.result.view(x.dtype),
                                             self.ready, self.done, self.reduced, self.epochs, x.numel(),
                                             **common)
        h.check_if_free()
        return out

