"""The all-reduce over the heap, `HeapAllReduce`: one-shot for small messages (every rank pushes its
whole input to every peer's Lamport slots and sums what lands), two-shot for large ones (each chunk
summed by its owner, then gathered), picked per call by size (`auto`: the crossover tune measured)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.all_reduce import (
    CHUNK_BYTES,
    one_shot_all_reduce_kernel,
    sub_block,
    two_shot_all_reduce_kernel,
)
from tp_overlap_plugin.kernels.lamport import peers_pow2
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.options import DEFAULT_MAX_BYTES  # the capacity: larger messages take the stock all-reduce
from tp_overlap_plugin.ops.device import cache_modifiers, resident_programs, warp_size
from tp_overlap_plugin.ops.slots import BITS, bits_view, round_up

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DEFAULT_ONE_SHOT_BYTES = 1 << 20

ALGORITHMS = ("auto", "one_shot", "two_shot")

# 256 threads: a chunk is 16 bf16 per thread, and so is a receive tile (no spills at W = 2..8, sm_90)
NUM_WARPS = 8


class HeapAllReduce:
    """Sum a tensor across the heap's ranks: `out = comm(x)`. Collective: every rank calls it with
    the same shape, dtype and algorithm, in the same order.

    `algorithm`: "one_shot" (messages up to `one_shot_max_bytes`), "two_shot" (up to `max_bytes`),
    or "auto": one-shot up to `auto_one_shot_bytes` (default and at most `one_shot_max_bytes`; the
    dispatch table's measured crossover for this device and world size), two-shot above. An algorithm asked for by name
    always runs or raises: a message it does not cover is a ValueError naming the limit, never a
    quiet switch. With "auto", messages no kernel covers (another dtype, non-contiguous, over
    `max_bytes`) go through torch.distributed on `device_group`; `stats` records which path ran.

    Heap use: 2 * W * one_shot_max_bytes (one-shot receive slots) + about 4 * max_bytes (two-shot
    scatter and gather slots), see heap_bytes(). On the CPU the heap's error slot is checked after
    every call; on a GPU that would cost a device sync per call, so callers check `heap.check()` at
    their own sync points (the engine: once a step).
    """

    def __init__(self, heap: SymmetricHeap, max_bytes: int = DEFAULT_MAX_BYTES,
                 device_group: dist.ProcessGroup | None = None, one_shot_max_bytes: int | None = None,
                 auto_one_shot_bytes: int | None = None):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if one_shot_max_bytes is not None and one_shot_max_bytes <= 0:
            raise ValueError(f"one_shot_max_bytes must be positive, got {one_shot_max_bytes}")
        self.heap = heap
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W = heap.world_size
        self.world = W
        self.chunk_bytes = CHUNK_BYTES
        layout = self.layout(W, max_bytes, one_shot_max_bytes)
        self.max_bytes, self.one_shot_bytes = layout["max_bytes"], layout["one_shot_bytes"]
        # "auto"'s crossover: measured per device and world size by tune (the dispatch table's
        # one_shot_max_bytes), at most what the one-shot's slots hold
        self.auto_one_shot_bytes = min(self.one_shot_bytes, self.one_shot_bytes if auto_one_shot_bytes is None
                                       else max(auto_one_shot_bytes, 0))
        self.scatter_chunks = layout["scatter_chunks"]
        self.one_shot_slots = heap.alloc((2, W, self.one_shot_bytes), torch.uint8, name="all_reduce.one_shot")
        self.scatter_slots = heap.alloc((2, W, self.scatter_chunks * self.chunk_bytes), torch.uint8,
                                        name="all_reduce.scatter")
        self.gather_slots = heap.alloc((2, self.max_bytes), torch.uint8, name="all_reduce.gather")
        self.one_shot_epochs = heap.alloc((self.one_shot_bytes // self.chunk_bytes,), torch.int64,
                                          name="all_reduce.one_shot_epochs")
        self.two_shot_epochs = heap.alloc((self.max_bytes // self.chunk_bytes,), torch.int64,
                                          name="all_reduce.two_shot_epochs")
        for slots in (self.one_shot_slots, self.scatter_slots, self.gather_slots):
            slots.fill_(0xFF)  # NOT_YET in every element, whatever the dtype
        for t in (self.one_shot_epochs, self.two_shot_epochs):
            t.zero_()
        self.num_programs = resident_programs(heap.device)
        self.cache_modifiers = cache_modifiers(heap.device)
        self.stream_order = runtime.StreamOrder()
        # per element size and algorithm, the kernel's launcher with everything but the message bound
        # once (eager calls are host-bound: tp_overlap_plugin/launch.py)
        threads = NUM_WARPS * warp_size(heap.device)
        h = heap
        self._launch = {}
        for es in BITS:
            block = CHUNK_BYTES // es
            one_shot, scatter, gather = (bits_view(t, es) for t in (self.one_shot_slots, self.scatter_slots,
                                                                      self.gather_slots))
            comm = dict(rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error, WORLD=W, BLOCK=block,
                        num_warps=NUM_WARPS, **self.cache_modifiers)
            self._launch[es] = (block, {
                "one_shot": Launcher(one_shot_all_reduce_kernel, h.device, ("x_ptr", "out_ptr", "n"), **comm,
                                     slots_ptr=one_shot, epoch_ptr=self.one_shot_epochs,
                                     slot_stride=one_shot.stride(0), src_stride=one_shot.stride(1),
                                     PEERS=peers_pow2(W), SUB=sub_block(block, W, threads)),
                "two_shot": Launcher(two_shot_all_reduce_kernel, h.device, ("x_ptr", "out_ptr", "n"), **comm,
                                     scatter_ptr=scatter, gather_ptr=gather, epoch_ptr=self.two_shot_epochs,
                                     scatter_slot_stride=scatter.stride(0), scatter_src_stride=scatter.stride(1),
                                     gather_slot_stride=gather.stride(0))})
        heap.publish()

    @staticmethod
    def layout(world: int, max_bytes: int, one_shot_max_bytes: int | None = None) -> dict:
        """Capacities rounded to whole chunks (for every dtype), and the heap bytes they take."""
        cb = CHUNK_BYTES
        max_bytes = round_up(max_bytes, cb)
        one_shot = round_up(min(one_shot_max_bytes or DEFAULT_ONE_SHOT_BYTES, max_bytes), cb)
        scatter_chunks = -(-(max_bytes // cb) // world)
        heap = (2 * world * one_shot + 2 * world * scatter_chunks * cb + 2 * max_bytes
                + 8 * (one_shot + max_bytes) // cb + 5 * 256)
        return {"max_bytes": max_bytes, "one_shot_bytes": one_shot, "scatter_chunks": scatter_chunks,
                "heap_bytes": heap}

    @classmethod
    def heap_bytes(cls, world: int, max_bytes: int = DEFAULT_MAX_BYTES, one_shot_max_bytes: int | None = None) -> int:
        return cls.layout(world, max_bytes, one_shot_max_bytes)["heap_bytes"]

    def kernel_applies(self, x: torch.Tensor) -> bool:
        return (x.dtype in REDUCE_DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def algorithm_for(self, nbytes: int) -> str:
        """What "auto" runs for a covered message of this size."""
        return "one_shot" if nbytes <= self.auto_one_shot_bytes else "two_shot"

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
        nbytes = x.numel() * x.element_size()
        if not self.kernel_applies(x):
            if algorithm != "auto":
                raise ValueError(
                    f"all_reduce algorithm {algorithm!r} cannot run this message: the kernels take contiguous "
                    f"{', '.join(str(d) for d in REDUCE_DTYPES)} messages of up to max_bytes={self.max_bytes}; got "
                    f"{x.dtype}, {nbytes} bytes, contiguous={x.is_contiguous()}. Use algorithm='auto' to fall back "
                    f"to torch.distributed, or build HeapAllReduce with a larger max_bytes.")
            stats.record("all_reduce.fallback")
            out.copy_(x)
            dist.all_reduce(out, group=self.device_group)
            return out
        if algorithm == "auto":
            algorithm = self.algorithm_for(nbytes)
        elif algorithm == "one_shot" and nbytes > self.one_shot_bytes:
            raise ValueError(f"one-shot all_reduce of {nbytes} bytes exceeds one_shot_max_bytes="
                             f"{self.one_shot_bytes} (its receive slots take 2 * world * one_shot_max_bytes of "
                             f"heap); use algorithm='two_shot' or build HeapAllReduce with a larger "
                             f"one_shot_max_bytes")
        self.stream_order.before_call(x.device)
        stats.record(f"all_reduce.{algorithm}")
        block, launchers = self._launch[x.element_size()]
        launchers[algorithm](min(-(-x.numel() // block), self.num_programs), x, out, x.numel())
        self.heap.check_if_free()
        return out
