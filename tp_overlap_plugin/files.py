"""Files that other processes read or write at the same time: an exclusive flock, and whole-file writes.

Three places need them: the tables and tune's measurement store (two `tune` runs at once must leave one
valid file holding both runs' rows), and the CPU heap (the Triton interpreter's memory operations take
the lock of rank 0's heap file, heap_shm.py). One flock helper serves all of them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # no POSIX locks (Windows): writes stay atomic, a concurrent merge may keep one run's rows
    fcntl = None


@contextlib.contextmanager
def flocked(fd: int):
    """An exclusive flock on the open file `fd` for the block (a full fence on both sides)."""
    if fcntl is None:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def locked(path: str | os.PathLike):
    """An exclusive lock on `path`.lock for a read-modify-write of `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as f, flocked(f.fileno()):
        yield


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
