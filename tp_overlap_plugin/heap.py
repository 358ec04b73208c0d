"""The symmetric heap: one region of `heap_size` bytes per rank, mapped into every rank.

Every rank carves tensors from its region with the same sequence of `alloc` calls, so a tensor lives
at the same offset in every rank's heap. A kernel reaches a peer's copy by translating a local
pointer through `heap_bases` (kernels/rma.py): rank r's heap is mapped at `heap_bases[r]` in this
process.

Backends, chosen by device type (override with `backend=` or TP_OVERLAP_HEAP_BACKEND), one module each:
  * "torch"  - torch symmetric memory (CUDA; ROCm where torch supports it): heap_torch.py.
  * "ipc"    - cudaMalloc/hipMalloc + IPC handles through ctypes; the ROCm fallback: heap_ipc.py.
  * "shm"    - a /dev/shm file per rank mmap'd by all ranks; the Triton interpreter on the CPU
               dereferences these addresses directly, one memory operation at a time under a lock
               the ranks share (`InterpreterMemoryLock`): heap_shm.py.
A backend is an object made from the heap (it reads rank, world_size, group, device and heap_size) with
`map()` -> (this rank's uint8 buffer, every rank's buffer as mapped here) and `close()`.

The first bytes of every heap hold a control block: an error slot that bounded spin-waits fill in
when they give up (`check()` turns it into a RankTimeoutError) and the flags of the host barrier.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_overlap_plugin import error_slot, options
from tp_overlap_plugin.heap_ipc import IpcBackend
from tp_overlap_plugin.heap_shm import InterpreterMemoryLock, ShmBackend
from tp_overlap_plugin.heap_torch import TorchSymmBackend
from tp_overlap_plugin.kernels.error_slot import ERR_TIMEOUT_NS, ERR_WORDS

ALIGN = 256
DEFAULT_HEAP_SIZE = 256 << 20
HEAP_SIZE_SETTING = "heap_size (TP_OVERLAP_HEAP_SIZE, or tp_overlap.heap_size in the engine config)"


class HeapExhaustedError(MemoryError):
    pass


class RankTimeoutError(RuntimeError):
    """A bounded spin-wait gave up: a peer never set the flag it was waiting for (or, at AG-GEMM, a
    peer whose wait gave up overwrote rows this rank was reading)."""


def default_backend(device: torch.device) -> str:
    env = options.env_heap_backend()
    if env:
        return env
    if device.type == "cpu":
        return "shm"
    if torch.version.hip is not None:
        # torch's ROCm symmetric memory goes through VMM/DMA-BUF and had a double-hipMemMap bug
        # until mid-2026; plain hipMalloc + IPC handles map XGMI peers directly.
        return "ipc"
    return "torch"


def default_heap_size() -> int:
    size = options.env_heap_size()
    return DEFAULT_HEAP_SIZE if size is None else size


# How long a wait on a peer spins before it gives up, in seconds of wall-clock time, whatever the world
# size, the device or the cost of a poll. Long enough for a peer's first-time JIT compile or a GC
# pause (the engine compiles every kernel it can hit during warm-up); a dead peer is reported after it.
DEFAULT_HEAP_TIMEOUT_S = 60.0
HEAP_TIMEOUT_SETTING = "heap_timeout_s (TP_OVERLAP_HEAP_TIMEOUT_S, or tp_overlap.heap_timeout_s in the engine config)"


def default_timeout_s() -> float:
    seconds = options.env_heap_timeout_s(HEAP_TIMEOUT_SETTING)
    return DEFAULT_HEAP_TIMEOUT_S if seconds is None else seconds


@dataclass(frozen=True)
class Allocation:
    name: str
    offset: int
    nbytes: int


class SymmetricHeap:
    """One rank's view of the symmetric heap. Collective: every rank constructs it together."""

    POLL_EVERY = 16  # poll(): one device-to-host copy of the error word per this many calls

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | str,
                 heap_size: int | None = None, backend: str | None = None,
                 timeout_s: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.heap_size = int(heap_size if heap_size is not None else default_heap_size())
        if self.heap_size < 64 << 10 or self.heap_size % ALIGN:
            raise ValueError(f"heap_size must be a multiple of {ALIGN} bytes and at least 64 KiB, "
                             f"got {self.heap_size}")
        self.backend_name = backend or default_backend(self.device)
        backend_cls = _BACKENDS.get(self.backend_name)
        if backend_cls is None:
            raise ValueError(f"unknown heap backend {self.backend_name!r}; choose from {sorted(_BACKENDS)}")
        self._backend = backend_cls(self)
        self.buffer, self.peer_buffers = self._backend.map()
        bases = [b.data_ptr() for b in self.peer_buffers]
        if any(b % ALIGN for b in bases):
            # rma.translate promises the compiler that peers' heaps are ALIGN apart (vector access)
            raise RuntimeError(f"heap backend {self.backend_name!r} mapped a heap at a base not aligned to "
                               f"{ALIGN} bytes: {[hex(b) for b in bases]}")
        self.heap_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self._offset = 0
        self._allocations: list[Allocation] = []
        self._closed = False
        self._error_seen = None  # poll()'s pinned copy of the error word
        self._polls = 0
        self.error = self.alloc((ERR_WORDS,), torch.int64, name="error_slot")
        self.error.zero_()
        self.timeout_s = timeout_s if timeout_s is not None else default_timeout_s()
        from tp_overlap_plugin.runtime import StreamOrder
        self._barrier_order = StreamOrder()
        self._barrier_flags = self.alloc((self.world_size,), torch.int64, name="host_barrier.flags")
        self._barrier_flags.zero_()
        self._barrier_epoch = self.alloc((1,), torch.int64, name="host_barrier.epoch")
        self._barrier_epoch.zero_()
        self.publish()

    # ---- allocation -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self._offset

    @property
    def free(self) -> int:
        return self.heap_size - self._offset

    def alloc(self, shape, dtype: torch.dtype, name: str = "tensor") -> torch.Tensor:
        """Carve a tensor at the next ALIGN-aligned offset. Every rank must make the same calls."""
        self._check_open()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        numel = 1
        for s in shape:
            numel *= s
        elsize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * elsize
        start = -(-self._offset // ALIGN) * ALIGN
        if start + nbytes > self.heap_size:
            raise HeapExhaustedError(
                f"symmetric heap exhausted allocating {name!r}: requested {nbytes} bytes, "
                f"{max(self.heap_size - start, 0)} of {self.heap_size} bytes free; raise {HEAP_SIZE_SETTING}")
        self._offset = start + nbytes
        self._allocations.append(Allocation(name, start, nbytes))
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    @contextlib.contextmanager
    def scope(self):
        """Allocations made inside are released on exit, so per-step scratch reuses the space."""
        mark, count = self._offset, len(self._allocations)
        try:
            yield self
        finally:
            self._offset = mark
            del self._allocations[count:]

    def offset_of(self, t: torch.Tensor) -> int:
        off = t.data_ptr() - self.buffer.data_ptr()
        if not 0 <= off < self.heap_size:
            raise ValueError("tensor does not live in this symmetric heap")
        return off

    def peer_view(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        """The same tensor in `peer`'s heap, as a tensor of this process (host-side access)."""
        off = self.offset_of(t)
        nbytes = t.numel() * t.element_size()
        return self.peer_buffers[peer][off:off + nbytes].view(t.dtype).view(t.shape)

    def describe_offset(self, off: int) -> str:
        for a in reversed(self._allocations):
            if a.offset <= off < a.offset + max(a.nbytes, 1):
                return f"{a.name}+{off - a.offset}B"
        return f"heap offset {off}"

    # ---- errors and host synchronisation ------------------------------------------------------

    @property
    def timeout_s(self) -> float:
        """How long a kernel's wait on a peer spins before it gives up (seconds, wall clock)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        if not 0 < seconds < 1e9:
            raise ValueError(f"heap timeout must be a positive number of seconds, got {seconds}; "
                             f"set {HEAP_TIMEOUT_SETTING}")
        self._timeout_s = float(seconds)
        # a device word the kernels read (rma.timeout_ns), written in stream order before later launches
        self.error[ERR_TIMEOUT_NS] = int(seconds * 1e9)

    def check(self) -> None:
        """Raise if a kernel of this rank gave up waiting on a peer. Synchronises with the device."""
        failure = error_slot.failure(self.error.tolist(), self.timeout_s, self.describe_offset)
        if failure is not None:
            raise RankTimeoutError(failure)

    def poll(self) -> None:
        """Raise like check() when the device has already recorded a failed wait, without waiting
        for the device; for engines that have no sync point of their own to check at.

        On a GPU it reads the error word that an earlier poll copied to pinned host memory, and
        every POLL_EVERY-th call queues the next such copy behind the work queued so far. So an
        error surfaces some polls after the kernel that recorded it has run. Nothing happens
        while a CUDA graph is being captured (a copy queued then would become part of the graph)."""
        if self.device.type != "cuda":
            self.check()
            return
        from tp_overlap_plugin import runtime
        if runtime.capturing(self.device):
            return
        self.raise_if_seen()
        if self._polls % self.POLL_EVERY == 0:
            self.queue_error_copy()
        self._polls += 1

    def queue_error_copy(self) -> None:
        """Queue a copy of the error word into pinned host memory behind the work queued so far on
        the current stream (inside a graph capture: a node of the graph, run by every replay)."""
        if self._error_seen is None:
            self._error_seen = torch.zeros(1, dtype=torch.int64).pin_memory()
            self._error_seen_view = self._error_seen.numpy()
        self._error_seen.copy_(self.error[:1], non_blocking=True)

    def raise_if_seen(self) -> None:
        """Raise like check() if the last copy of the error word that has landed on the host shows a
        failed wait; reads host memory only."""
        if self._error_seen is not None and self._error_seen_view[0] != 0:
            self.check()

    def memory_lock(self):
        """A context in which host stores into the CPU heap are ordered with the interpreter's memory
        operations of every rank (they take the same lock: InterpreterMemoryLock); a no-op on GPUs."""
        return InterpreterMemoryLock.holding() if self.device.type == "cpu" else contextlib.nullcontext()

    def check_if_free(self) -> None:
        """After a launch: check where reading the error slot costs nothing (the CPU). On a GPU it is a
        device sync per op, so callers check at their own sync points (the engine: once a step)."""
        if self.device.type == "cpu":
            self.check()

    def publish(self) -> None:
        """Make freshly zeroed flags safe to use: my device work (the zeroing) finishes, then every rank
        meets, so no peer raises a flag in my heap before it is zeroed, and no peer kernel still
        touches space that was just handed out again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def barrier(self) -> None:
        """Device-side barrier across the heap's ranks (the same kernel graphs capture)."""
        from tp_overlap_plugin.kernels.barrier import launch_barrier
        from tp_overlap_plugin.ops.device import cache_modifiers
        self._barrier_order.before_call(self.device)
        launch_barrier(self, self._barrier_flags, self._barrier_epoch, cache_modifiers(self.device)["POLL_LOAD"])
        self.check_if_free()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("symmetric heap is closed")

    def __repr__(self):
        return (f"SymmetricHeap(rank={self.rank}/{self.world_size}, device={self.device}, "
                f"backend={self.backend_name}, used={self.used}/{self.heap_size})")


_BACKENDS = {"shm": ShmBackend, "torch": TorchSymmBackend, "ipc": IpcBackend}
