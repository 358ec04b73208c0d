"""The symmetric heap: one region of `heap_size` bytes per rank, mapped into every rank.

Every rank carves tensors from its region with the same sequence of `alloc` calls, so a tensor lives
at the same offset in every rank's heap. A kernel reaches a peer's copy by translating a local
pointer through `heap_bases` (kernels/rma.py): rank r's heap is mapped at `heap_bases[r]` in this
process.

Backends, chosen by device type (override with `backend=` or TP_OVERLAP_HEAP_BACKEND):
  * "torch"  - torch symmetric memory (CUDA; ROCm where torch supports it).
  * "ipc"    - cudaMalloc/hipMalloc + IPC handles through ctypes; the ROCm fallback.
  * "shm"    - a /dev/shm file per rank mmap'd by all ranks; the Triton interpreter on the CPU
               dereferences these addresses directly, one memory operation at a time under a lock
               the ranks share (`_InterpreterMemoryLock`).

The first bytes of every heap hold a control block: an error slot that bounded spin-waits fill in
when they give up (`check()` turns it into a RankTimeoutError) and the flags of the host barrier.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import mmap
import os
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

ALIGN = 256
DEFAULT_HEAP_SIZE = 256 << 20
HEAP_SIZE_SETTING = "heap_size (TP_OVERLAP_HEAP_SIZE, or tp_overlap.heap_size in the engine config)"
SHM_PREFIX = "tp_overlap-"

# Error-slot layout (int64 words), mirrored in kernels/rma.py. Written only by a kernel whose wait gave
# up, except ERR_TIMEOUT_NS: the wait bound that kernels read, set by the host.
ERR_CODE, ERR_RANK, ERR_PEER, ERR_FLAG_OFFSET, ERR_EXPECTED, ERR_SEEN = range(6)
ERR_TIMEOUT_NS = 7
ERR_WORDS = 8
ERR_TIMEOUT = 1      # a wait gave up (kernels/rma.py ERR_STUCK)


class HeapExhaustedError(MemoryError):
    pass


class RankTimeoutError(RuntimeError):
    """A bounded spin-wait gave up: a peer never set the flag it was waiting for (or, at AG-GEMM, a
    peer whose wait gave up overwrote rows this rank was reading)."""


def default_backend(device: torch.device) -> str:
    env = os.environ.get("TP_OVERLAP_HEAP_BACKEND")
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
    return int(os.environ.get("TP_OVERLAP_HEAP_SIZE", DEFAULT_HEAP_SIZE))


# How long a wait on a peer spins before it gives up, in seconds of wall-clock time, whatever the world
# size, the device or the cost of a poll. Long enough for a peer's first-time JIT compile or a GC
# pause (the engine compiles every kernel it can hit during warm-up); a dead peer is reported after it.
DEFAULT_HEAP_TIMEOUT_S = 60.0
HEAP_TIMEOUT_SETTING = "heap_timeout_s (TP_OVERLAP_HEAP_TIMEOUT_S, or tp_overlap.heap_timeout_s in the engine config)"


def default_timeout_s() -> float:
    if os.environ.get("TP_OVERLAP_SPIN_LIMIT"):
        warnings.warn("TP_OVERLAP_SPIN_LIMIT is no longer read: waits are bounded in seconds by "
                      f"{HEAP_TIMEOUT_SETTING}", stacklevel=3)
    return float(os.environ.get("TP_OVERLAP_HEAP_TIMEOUT_S", DEFAULT_HEAP_TIMEOUT_S))


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
        err = self.error.tolist()
        if err[ERR_CODE] == 0:
            return
        raise RankTimeoutError(
            f"rank {err[ERR_RANK]} gave up after {self.timeout_s:g} s waiting for rank "
            f"{err[ERR_PEER]} to set flag {self.describe_offset(err[ERR_FLAG_OFFSET])} to epoch "
            f"{err[ERR_EXPECTED]} (saw {err[ERR_SEEN]}); the peer crashed, hung, or the ranks "
            f"issued different collectives. The heap is unusable now; restart the group.")

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
        operations of every rank (they take the same lock: _InterpreterMemoryLock); a no-op on GPUs."""
        return _InterpreterMemoryLock.holding() if self.device.type == "cpu" else contextlib.nullcontext()

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
        self._barrier_order.before_call(self.device)
        launch_barrier(self, self._barrier_flags, self._barrier_epoch)
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


# ---- backends ---------------------------------------------------------------------------------


class _ShmBackend:
    """A /dev/shm file per rank. Files are unlinked as soon as every rank has mapped them, so a
    crash after setup leaves nothing behind; before that, an atexit hook and the harness clean up."""

    def __init__(self, heap: SymmetricHeap):
        self.heap = heap
        self.maps: list[mmap.mmap] = []
        self.paths: list[str] = []
        self.lock: _InterpreterMemoryLock | None = None

    def map(self):
        h = self.heap
        token = [uuid.uuid4().hex[:12] if h.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(h.group, 0), group=h.group)
        path = f"/dev/shm/{SHM_PREFIX}{os.getpid()}-{token[0]}-r{h.rank}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _register_unlink(path)
        try:
            os.ftruncate(fd, h.heap_size)
        finally:
            os.close(fd)
        paths = [None] * h.world_size
        dist.all_gather_object(paths, path, group=h.group)
        buffers = []
        for p in paths:
            fd = os.open(p, os.O_RDWR)
            try:
                m = mmap.mmap(fd, h.heap_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.maps.append(m)
            buffers.append(torch.frombuffer(m, dtype=torch.uint8))
        # rank 0's file is the world's lock; opened before the unlink below, the fd outlives it
        self.lock = _InterpreterMemoryLock(os.open(paths[0], os.O_RDWR))
        dist.barrier(group=h.group)
        _unlink_now(path)
        return buffers[h.rank], buffers

    def close(self):
        # Tensors created by frombuffer pin the mmaps; dropping our references is enough.
        self.maps.clear()
        if self.lock is not None:
            self.lock.release()


class _InterpreterMemoryLock:
    """Makes each of the Triton interpreter's memory operations whole with respect to other ranks.

    The interpreter loads and stores an element with a libc memcpy, which copies a 2-byte element
    as a 2-byte access plus a second access to its last byte (4- and 8-byte elements: two
    overlapping accesses). Between processes that breaks what GPUs guarantee for aligned 16/32/64-
    bit accesses (single-copy atomicity), and the Lamport all-reduce depends on it twice: a poll
    could see a half-written element that no longer reads as NOT_YET, and a pusher's late second
    access could land after the reader has consumed the element and put NOT_YET back, leaving a
    value the next call takes as arrived. (Both were caught in CPU stress runs at 8 ranks; the
    interpreter's atomics are not atomic across processes either.)

    So every interpreter load, store and atomic takes an exclusive flock on rank 0's heap file,
    which every rank of the world holds open. It is per operation (a whole tile), so spins still
    interleave with the peers' pushes. A process-wide patch of triton.runtime.interpreter's
    native module: the most recently mapped heap's lock applies (ranks map their heaps in the
    same order, so they agree on it), and closing a heap falls back to the one mapped before."""

    OPS = ("load", "store", "atomic_cas", "atomic_rmw")
    _held: list["_InterpreterMemoryLock"] = []  # mapped heaps' locks, newest last

    def __init__(self, fd: int):
        self.fd = fd
        # a heap in host memory is only ever run by the interpreter
        from tp_overlap_plugin.kernels import triton_compat
        native = triton_compat.interpreter_native()
        if not isinstance(native, _LockedNative):
            missing = [op for op in self.OPS if not hasattr(native, op)]
            if missing:
                raise RuntimeError(f"this Triton's interpreter has no {missing} in its native module; the CPU "
                                   f"heap cannot make its memory operations atomic between ranks")
            triton_compat.set_interpreter_native(_LockedNative(native))
        self._held.append(self)

    @classmethod
    @contextlib.contextmanager
    def holding(cls):
        """The lock the interpreter's memory operations take now, held by the host (a flock: a full
        fence on both sides)."""
        fd = cls._held[-1].fd if cls._held else None
        if fd is None:
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def release(self) -> None:
        if self in self._held:
            self._held.remove(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _LockedNative:
    """triton.runtime.interpreter's native module, with the memory operations under the lock of
    the newest mapped heap (`_InterpreterMemoryLock`); everything else passes through."""

    def __init__(self, native):
        self._native = native
        for op in _InterpreterMemoryLock.OPS:
            setattr(self, op, self._locked(getattr(native, op)))

    def __getattr__(self, name):
        return getattr(self._native, name)

    @staticmethod
    def _locked(fn):
        def call(*args):
            held = _InterpreterMemoryLock._held
            if not held:
                return fn(*args)
            fd = held[-1].fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                return fn(*args)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return call


class _TorchSymmBackend:
    def __init__(self, heap: SymmetricHeap):
        self.heap = heap

    def map(self):
        import torch.distributed._symmetric_memory as symm_mem
        h = self.heap
        group_name = h.group.group_name  # torch >= 2.11 needs no enable_symm_mem_for_group first
        with torch.cuda.device(h.device):
            self.local = symm_mem.empty(h.heap_size, dtype=torch.uint8, device=h.device)
            self.handle = symm_mem.rendezvous(self.local, group_name)
        peers = [self.handle.get_buffer(r, (h.heap_size,), torch.uint8) if r != h.rank else self.local
                 for r in range(h.world_size)]
        return self.local, peers

    def close(self):
        pass


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t / hipIpcMemHandle_t: a struct of 64 opaque bytes. IpcOpenMemHandle takes it
    by value; ctypes passes an array as a pointer, which made cudaIpcOpenMemHandle fail (rc=1) on
    H200. A Structure declared in argtypes is passed by value."""
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def runtime_signatures() -> dict:
    """C signatures of the runtime calls the ipc backend makes, by name without the cuda/hip prefix:
    name -> (restype, argtypes). Both runtimes declare them alike (errors are a C enum, an int)."""
    err = ctypes.c_int
    return {
        "SetDevice": (err, [ctypes.c_int]),
        "Malloc": (err, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
        "Free": (err, [ctypes.c_void_p]),
        "IpcGetMemHandle": (err, [ctypes.POINTER(IpcMemHandle), ctypes.c_void_p]),
        "IpcOpenMemHandle": (err, [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]),
        "IpcCloseMemHandle": (err, [ctypes.c_void_p]),
        "GetErrorString": (ctypes.c_char_p, [err]),
    }


def configure_runtime(lib, prefix: str):
    """Set restype and argtypes of every runtime function the ipc backend calls on `lib` (a
    ctypes.CDLL, or any object whose `<prefix><name>` attributes take them). Without argtypes ctypes
    guesses each argument's C type from the Python value, and the guess is wrong for the handle."""
    for name, (restype, argtypes) in runtime_signatures().items():
        fn = getattr(lib, prefix + name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


class IpcRuntime:
    """The CUDA or HIP runtime calls behind the ipc backend, through ctypes with declared signatures."""

    LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess = hipIpcMemLazyEnablePeerAccess

    def __init__(self, lib, prefix: str):
        self.lib = configure_runtime(lib, prefix)
        self.prefix = prefix

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, self.prefix + name)(*args)
        if rc != 0:
            what = getattr(self.lib, self.prefix + "GetErrorString")(rc)
            raise RuntimeError(f"{self.prefix}{name} failed with error code {rc}"
                               f" ({what.decode(errors='replace') if what else 'no description'})")

    def set_device(self, index: int) -> None:
        self._call("SetDevice", index)

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("Malloc", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("Free", ptr)

    def get_handle(self, ptr: int) -> bytes:
        handle = IpcMemHandle()
        self._call("IpcGetMemHandle", ctypes.byref(handle), ptr)
        return bytes(handle)

    def open_handle(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        self._call("IpcOpenMemHandle", ctypes.byref(ptr), IpcMemHandle.from_buffer_copy(handle),
                   self.LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def close_handle(self, ptr: int) -> None:
        self._call("IpcCloseMemHandle", ptr)


class _IpcBackend:
    """Runtime malloc + IPC handles through ctypes (libamdhip64 on ROCm, libcudart on CUDA).

    The heap must come from the runtime's own malloc (IPC on memory from torch's caching allocator
    failed here), and peers' handles are opened on the local device: opening them under the
    peer's device guard gave addresses the kernel faulted on. The runtime is told the device
    itself: if this process has two copies of the runtime (torch's and a system one), torch's
    device guard sets only its own copy's current device."""

    def __init__(self, heap: SymmetricHeap):
        self.heap = heap
        hip = torch.version.hip is not None
        self.rt = IpcRuntime(_load_runtime(hip), "hip" if hip else "cuda")
        self.local_ptr = 0
        self.opened: list[int] = []

    def map(self):
        h = self.heap
        with torch.cuda.device(h.device):
            self.rt.set_device(h.device.index)
            self.local_ptr = self.rt.malloc(h.heap_size)
            handles = [None] * h.world_size
            dist.all_gather_object(handles, self.rt.get_handle(self.local_ptr), group=h.group)
            ptrs = []
            for r, handle in enumerate(handles):
                if r == h.rank:
                    ptrs.append(self.local_ptr)
                    continue
                peer_ptr = self.rt.open_handle(handle)
                self.opened.append(peer_ptr)
                ptrs.append(peer_ptr)
        buffers = [_wrap_device_pointer(p, h.heap_size, h.device, owner=self) for p in ptrs]
        return buffers[h.rank], buffers

    def close(self):
        with torch.cuda.device(self.heap.device):
            torch.cuda.synchronize()
            self.rt.set_device(self.heap.device.index)
            for p in self.opened:
                with contextlib.suppress(RuntimeError):
                    self.rt.close_handle(p)
            self.opened.clear()
            if self.local_ptr:
                with contextlib.suppress(RuntimeError):
                    self.rt.free(self.local_ptr)
                self.local_ptr = 0


_BACKENDS = {"shm": _ShmBackend, "torch": _TorchSymmBackend, "ipc": _IpcBackend}


def _load_runtime(hip: bool):
    stem = "libamdhip64.so" if hip else "libcudart.so"
    names = ([stem, stem + ".6", stem + ".7"] if hip else [stem, stem + ".13", stem + ".12"])
    found = ctypes.util.find_library("amdhip64" if hip else "cudart")
    if found:
        names.insert(0, found)
    # The copy torch already loaded comes first: one runtime, one device state, one set of mappings.
    names[:0] = _loaded_libraries(stem)
    if not hip:
        # pip wheels of the CUDA runtime sit beside torch rather than on the loader path
        try:
            import nvidia.cuda_runtime as ncr  # type: ignore
            for d in ncr.__path__:
                for sub in ("lib", ""):
                    libdir = os.path.join(d, sub)
                    if os.path.isdir(libdir):
                        names += [os.path.join(libdir, f) for f in sorted(os.listdir(libdir))
                                  if f.startswith("libcudart.so")]
        except ImportError:
            pass
    errors = []
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError as e:
            errors.append(f"{n}: {e}")
    raise RuntimeError("heap backend 'ipc' could not load the GPU runtime: " + "; ".join(errors))


def _loaded_libraries(stem: str) -> list[str]:
    """Paths of shared objects named `stem*` already mapped into this process (Linux)."""
    paths = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(stem) and path not in paths:
                    paths.append(path)
    return paths


class _DeviceArray:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _wrap_device_pointer(ptr: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    t = torch.as_tensor(_DeviceArray(ptr, nbytes), device=device)
    # keep the backend (which frees the memory) alive as long as any view exists
    weakref.finalize(t, lambda o: None, owner)
    return t


# ---- /dev/shm hygiene -------------------------------------------------------------------------

_pending_unlinks: set[str] = set()


def _unlink_now(path: str) -> None:
    _pending_unlinks.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _unlink_all() -> None:
    for p in list(_pending_unlinks):
        _unlink_now(p)


def _register_unlink(path: str) -> None:
    if not _pending_unlinks:
        import atexit
        atexit.register(_unlink_all)
    _pending_unlinks.add(path)


def remove_stale_shm(pids) -> list[str]:
    """Remove heap files created by the given (dead) processes; the harness calls this."""
    removed = []
    pids = {str(p) for p in pids}
    for name in os.listdir("/dev/shm"):
        if name.startswith(SHM_PREFIX) and name[len(SHM_PREFIX):].split("-", 1)[0] in pids:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
    return removed
