"""The CPU heap backend: a /dev/shm file per rank, mmap'd by every rank, wrapped with torch.frombuffer.
The Triton interpreter dereferences these addresses directly; `InterpreterMemoryLock` keeps its memory
operations whole between ranks. Files are unlinked once mapped, at exit, and by the test harness after
a crash (`remove_stale_shm`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid

import torch
import torch.distributed as dist

from tp_overlap_plugin.files import flocked

SHM_PREFIX = "tp_overlap-"


class ShmBackend:
    """A /dev/shm file per rank. Files are unlinked as soon as every rank has mapped them, so a
    crash after setup leaves nothing behind; before that, an atexit hook and the harness clean up."""

    def __init__(self, heap):
        self.heap = heap
        self.maps: list[mmap.mmap] = []
        self.paths: list[str] = []
        self.lock: InterpreterMemoryLock | None = None

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
        self.lock = InterpreterMemoryLock(os.open(paths[0], os.O_RDWR))
        dist.barrier(group=h.group)
        _unlink_now(path)
        return buffers[h.rank], buffers

    def close(self):
        # Tensors created by frombuffer pin the mmaps; dropping our references is enough.
        self.maps.clear()
        if self.lock is not None:
            self.lock.release()


class InterpreterMemoryLock:
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
    _held: list["InterpreterMemoryLock"] = []  # mapped heaps' locks, newest last

    def __init__(self, fd: int):
        self.fd = fd
        # a heap in host memory is only ever run by the interpreter
        from tp_overlap_plugin.kernels import triton_compat
        native = triton_compat.interpreter_native()
        if not isinstance(native, LockedNative):
            missing = [op for op in self.OPS if not hasattr(native, op)]
            if missing:
                raise RuntimeError(f"this Triton's interpreter has no {missing} in its native module; the CPU "
                                   f"heap cannot make its memory operations atomic between ranks")
            triton_compat.set_interpreter_native(LockedNative(native))
        self._held.append(self)

    @classmethod
    @contextlib.contextmanager
    def holding(cls):
        """The lock the interpreter's memory operations take now, held by the host (a flock: a full
        fence on both sides)."""
        fd = cls._held[-1].fd if cls._held else None
        with contextlib.nullcontext() if fd is None else flocked(fd):
            yield

    def release(self) -> None:
        if self in self._held:
            self._held.remove(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class LockedNative:
    """triton.runtime.interpreter's native module, with the memory operations under the lock of
    the newest mapped heap (`InterpreterMemoryLock`); everything else passes through."""

    def __init__(self, native):
        self._native = native
        for op in InterpreterMemoryLock.OPS:
            setattr(self, op, self._locked(getattr(native, op)))

    def __getattr__(self, name):
        return getattr(self._native, name)

    @staticmethod
    def _locked(fn):
        def call(*args):
            held = InterpreterMemoryLock._held
            if not held:
                return fn(*args)
            with flocked(held[-1].fd):
                return fn(*args)
        return call


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
