"""Host ops for collectives over the symmetric heap: the all-reduce (one-shot, two-shot), and the
all-reduce fused with the residual add and RMSNorm that follow a row-parallel layer in the
replicated (decode) layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.allreduce import (CHUNK_BYTES, one_shot_all_reduce_kernel, sub_block,
                                                 two_shot_all_reduce_kernel)
from tp_overlap_plugin.kernels.lamport import peers_pow2
from tp_overlap_plugin.kernels.allreduce_norm import all_reduce_rmsnorm_kernel, row_blocks

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_ONE_SHOT_BYTES = 1 << 20
ALGORITHMS = ("auto", "one_shot", "two_shot")
# 256 threads: a chunk is 16 bf16 per thread, and so is a receive tile (no spills at W = 2..8, sm_90)
NUM_WARPS = 8
# The fused all-reduce + norm holds a whole row per program (up to 16384 receive elements): 512
# threads (16 warps on NVIDIA, 8 wavefronts on CDNA, so a thread still pushes 16 bytes of a 4096-wide
# block) measured 0.1-0.7 us faster than 256 at hidden 4096-8192, 1-128 rows, a tie at 256 (H200 x2).
NORM_THREADS = 512
BITS = {2: torch.int16, 4: torch.int32}  # a float dtype's bits, by element size


def norm_num_warps(warp_size: int) -> int:
    return max(NORM_THREADS // warp_size, 1)


def warp_size(device: torch.device) -> int:
    """Threads of a warp (a wavefront on CDNA): the receive tiles are sized per thread
    (kernels/lamport.py: tile_elems). The interpreter's programs are sized as on NVIDIA."""
    return runtime.warp_size(device) if device.type == "cuda" else 32


def resident_programs(device: torch.device, cross_program_waits: bool = False) -> int:
    """Grid size of a kernel that spins on peers: one program per SM at most, so every program is
    resident at once and none spins on a peer program that its own rank has not scheduled. The
    interpreter runs a grid's programs one after another, so a kernel whose programs wait on other
    programs of their own rank (`cross_program_waits`) gets one program there."""
    if device.type == "cuda":
        return runtime.multiprocessor_count(device)
    return 1 if cross_program_waits else 4


def cache_modifiers(device: torch.device) -> dict:
    """On CDNA, stores to peer memory stay in the sender's L2 unless written through, and polls
    need a cache modifier to stay coherent (kernels/allreduce.py: _wait_landed)."""
    cdna = device.type == "cuda" and torch.version.hip is not None
    return {"PEER_STORE": ".wt" if cdna else "", "POLL_LOAD": ".cv" if cdna else ""}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Rows of a row-layout receive slot are padded to this many elements: every row starts 16-byte
# aligned (vector pushes) and the row stride is divisible by 16, which Triton specializes on.
SLOT_ROW_ALIGN = 16


def row_slots_bytes(world: int, max_rows: int, n: int, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return 2 * world * max_rows * _round_up(n, SLOT_ROW_ALIGN) * es


def alloc_row_slots(heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Receive slots for rows of n values of `dtype`, as its bits: [2 alternating calls, W source
    ranks, max_rows, n padded], NOT_YET in every element (kernels/allreduce.py). The fused
    all-reduce + norm and GEMM + all-reduce exchange rows through them."""
    es = torch.empty((), dtype=dtype).element_size()
    slots = heap.alloc((2, heap.world_size, max_rows, _round_up(n, SLOT_ROW_ALIGN)), BITS[es], name=name)
    slots.fill_(-1)
    return slots


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Addresses from a tensor's first to one past its last element."""
    lo = t.data_ptr()
    return lo, lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _outputs_overlap(outs, ins) -> bool:
    """Whether the memory span of any non-empty tensor of `outs` intersects one of `ins`."""
    for o in outs:
        if o is None or o.numel() == 0:
            continue
        o0, o1 = _span(o)
        for i in ins:
            i0, i1 = _span(i)
            if o0 < i1 and i0 < o1:
                return True
    return False


def _like(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """A tensor of this shape, dtype and device with unit last stride (what the row kernels index)."""
    return t.shape == shape and t.dtype == dtype and t.device == device and t.stride(-1) == 1


def _bits_view(buf: torch.Tensor, elsize: int) -> torch.Tensor:
    return buf.view(BITS[elsize])


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
            one_shot, scatter, gather = (_bits_view(t, es) for t in (self.one_shot_slots, self.scatter_slots,
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
        max_bytes = _round_up(max_bytes, cb)
        one_shot = _round_up(min(one_shot_max_bytes or DEFAULT_ONE_SHOT_BYTES, max_bytes), cb)
        scatter_chunks = -(-(max_bytes // cb) // world)
        heap = (2 * world * one_shot + 2 * world * scatter_chunks * cb + 2 * max_bytes
                + 8 * (one_shot + max_bytes) // cb + 5 * 256)
        return {"max_bytes": max_bytes, "one_shot_bytes": one_shot, "scatter_chunks": scatter_chunks,
                "heap_bytes": heap}

    @classmethod
    def heap_bytes(cls, world: int, max_bytes: int = DEFAULT_MAX_BYTES, one_shot_max_bytes: int | None = None) -> int:
        return cls.layout(world, max_bytes, one_shot_max_bytes)["heap_bytes"]

    def kernel_applies(self, x: torch.Tensor) -> bool:
        return (x.dtype in KERNEL_DTYPES and x.is_contiguous()
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
                    f"{', '.join(str(d) for d in KERNEL_DTYPES)} messages of up to max_bytes={self.max_bytes}; got "
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


class HeapAllReduceNorm:
    """The all-reduce of a row-parallel layer's partial output fused with what follows it in the
    replicated (decode) layout, one kernel:

        new_residual = all_reduce(x) [+ bias] + residual      (each rounded to the dtype, as the
        normed = weight * rmsnorm(new_residual)                 stock all-reduce + layer_ops.rmsnorm do)

    x, residual: [T, hidden] rows (contiguous rows, any row stride), T <= max_rows. One-shot: every
    rank pushes its rows to every peer (2 * W * max_rows * hidden elements of heap). Collective like
    HeapAllReduce; `dtype` is fixed at construction.
    """

    def __init__(self, heap: SymmetricHeap, hidden: int, max_rows: int, dtype: torch.dtype):
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"all_reduce_rmsnorm dtype must be one of {KERNEL_DTYPES}, got {dtype}")
        if hidden <= 0 or max_rows <= 0:
            raise ValueError(f"all_reduce_rmsnorm needs hidden > 0 and max_rows > 0, got {hidden}, {max_rows}")
        self.heap, self.hidden, self.max_rows, self.dtype = heap, hidden, max_rows, dtype
        self._weight_shape = torch.Size((hidden,))
        W, es = heap.world_size, torch.empty((), dtype=dtype).element_size()
        self.num_warps = norm_num_warps(warp_size(heap.device))
        self.slots = alloc_row_slots(heap, max_rows, hidden, dtype, "all_reduce_norm.slots")
        self.block, self.sub = row_blocks(hidden, W, es, self.num_warps * warp_size(heap.device))
        self.pieces = triton.cdiv(hidden, self.block)  # a row goes out in this many pushes
        self.push_epochs = heap.alloc((max_rows * self.pieces,), torch.int64, name="all_reduce_norm.push_epochs")
        self.row_epochs = heap.alloc((max_rows,), torch.int64, name="all_reduce_norm.row_epochs")
        for t in (self.push_epochs, self.row_epochs):
            t.zero_()
        # a row's pieces may be pushed by another program than the one that waits for them
        self.num_programs = resident_programs(heap.device, cross_program_waits=True)
        self.stream_order = runtime.StreamOrder()
        self.launch = Launcher(
            all_reduce_rmsnorm_kernel, heap.device,
            ("x_ptr", "res_ptr", "w_ptr", "bias_ptr", "out_ptr", "res_out_ptr", "rows", "stride_x", "stride_res",
             "stride_out", "stride_res_out", "eps", "HAS_BIAS"),
            slots_ptr=self.slots, push_epoch_ptr=self.push_epochs, row_epoch_ptr=self.row_epochs, n=hidden,
            slot_stride=self.slots.stride(0), src_stride=self.slots.stride(1), row_stride=self.slots.stride(2),
            rank=heap.rank, heap_bases=heap.heap_bases, error_ptr=heap.error, WORLD=W, PEERS=peers_pow2(W),
            BLOCK=self.block, SUB=self.sub, ONE_TILE=hidden <= self.sub, num_warps=self.num_warps,
            **cache_modifiers(heap.device))
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, hidden: int, max_rows: int, dtype: torch.dtype) -> int:
        # the push block does not depend on the receive tile's threads
        block = row_blocks(hidden, world, torch.empty((), dtype=dtype).element_size(), NORM_THREADS)[0]
        epochs = max_rows * (triton.cdiv(hidden, block) + 1)  # push_epochs and row_epochs
        return row_slots_bytes(world, max_rows, hidden, dtype) + 8 * epochs + 3 * 256

    def applies(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == self.dtype and x.shape[1] == self.hidden and x.shape[0] <= self.max_rows
                and x.stride(1) == 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new_residual): [T, hidden] each, new tensors unless `out` / `residual_out` are
        given (neither may overlap x or residual)."""
        # one expression on the path every valid call takes; the loops that name what is wrong run
        # only when it fails (eager calls are host-bound)
        shape, dt, dev = x.shape, self.dtype, self.heap.device
        if not (self.applies(x) and x.device == dev and _like(residual, shape, dt, dev)
                and _like(weight, self._weight_shape, dt, dev)
                and (bias is None or _like(bias, self._weight_shape, dt, dev))
                and (out is None or _like(out, shape, dt, dev))
                and (residual_out is None or _like(residual_out, shape, dt, dev))
                and not ((out is not None or residual_out is not None)
                         and _outputs_overlap((out, residual_out), (x, residual)))):
            self._raise_bad_call(x, residual, weight, bias, out, residual_out)
        rows = shape[0]
        normed = out if out is not None else torch.empty(shape, dtype=self.dtype, device=dev)
        new_residual = residual_out if residual_out is not None else torch.empty(shape, dtype=self.dtype, device=dev)
        if rows == 0:
            return normed, new_residual
        self.stream_order.before_call(dev)
        stats.record("all_reduce_norm.kernel")
        self.launch(min(rows * self.pieces, self.num_programs), x, residual, weight,
                    bias if bias is not None else weight, normed, new_residual, rows, x.stride(0), residual.stride(0),
                    normed.stride(0), new_residual.stride(0), eps, bias is not None)
        self.heap.check_if_free()
        return normed, new_residual

    def _raise_bad_call(self, x, residual, weight, bias, out, residual_out) -> None:
        if not self.applies(x):
            raise ValueError(f"all_reduce_rmsnorm takes [T <= {self.max_rows}, {self.hidden}] {self.dtype} rows with "
                             f"unit column stride; got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        for name, t, shape in (("residual", residual, tuple(x.shape)), ("weight", weight, (self.hidden,)),
                               ("bias", bias, (self.hidden,)), ("out", out, tuple(x.shape)),
                               ("residual_out", residual_out, tuple(x.shape))):
            if t is None:
                continue
            if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
                raise ValueError(f"all_reduce_rmsnorm {name} must be a {x.dtype} tensor of shape {shape} on "
                                 f"{x.device} with unit last stride; got {t.dtype} {tuple(t.shape)} on {t.device}, "
                                 f"strides {t.stride()}")
        if x.device != self.heap.device:
            raise ValueError(f"all_reduce_rmsnorm input is on {x.device}, but the heap is on {self.heap.device}")
        for name, t in (("out", out), ("residual_out", residual_out)):
            for src_name, src in (("x", x), ("residual", residual)):
                # the kernel stores rows while later rows (and peers' pushes of them) are still read
                if t is not None and _outputs_overlap((t,), (src,)):
                    raise ValueError(f"all_reduce_rmsnorm {name} overlaps {src_name}: the kernel writes a row's "
                                     f"outputs while it still reads the inputs; pass separate tensors")
        raise AssertionError("all_reduce_rmsnorm: a call failed its checks, and none says why")
