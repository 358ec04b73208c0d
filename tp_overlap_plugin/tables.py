"""Where the flag's measured tables come from, and how they are stored.

The dispatch table (tp_overlap_plugin/dispatch.py: which path wins per op, shape and size, and per step
size the engine's verdict), the GEMM core's config table (tp_overlap_plugin/gemm_config.py) and the
decode matmul's (tp_overlap_plugin/decode_config.py) are each looked up in this order:

  1. an explicit path (the `dispatch_table` option);
  2. the per-user cache that `tp-overlap tune` writes: `$TP_OVERLAP_CACHE`, else
     `$XDG_CACHE_HOME/tp-overlap`, else `~/.cache/tp-overlap`;
  3. the tables shipped in the package (`dispatch_tables/`, `gemm_tables/`, `decode_tables/`);
  4. none (the stock path everywhere; the GEMM core's on-paper constants).

A table that cannot be read or parsed is skipped with a warning: a table never fails a start. A
cached table measured under other versions (torch, Triton, driver) is used with one warning that it
may be stale; a shipped table measured on a different device likewise. Each warning names the
`tp-overlap tune` command that measures this machine.

`load` is the one loader of all three: it finds a table in that order and parses it, and one that does
not parse falls back like a missing one. The GEMM and decode tables are both a `BucketedTable`: per
measured M bucket and (N, K) shape the fastest config, per bucket the most frequent winner.

Writes are atomic (a temporary file in the same folder, then os.replace) and serialised by a lock
file, so two `tune` runs at once leave one valid file holding both runs' rows.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from tp_overlap_plugin import options

log = logging.getLogger(__name__)
PACKAGE_DIR = Path(__file__).parent
SHIPPED = {"dispatch": PACKAGE_DIR / "dispatch_tables", "gemm": PACKAGE_DIR / "gemm_tables",
           "decode": PACKAGE_DIR / "decode_tables"}
# the fields of a table's header that say what it was measured under (versions() makes them)
VERSION_KEYS = ("torch", "triton", "driver")
# words of a device name that name the vendor, memory or form factor, not the chip: the table of a
# chip serves its variants ("NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe" are both "h100"; the
# warning for a different device says when the variant differs from the one measured)
_NOT_CHIP = re.compile(r"^(nvidia|amd|instinct|vf|pcie|sxm\d*|nvl|\d+gb|hbm\d*e?)$")


def device_key(device_name: str) -> str:
    """The device part of a table's name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100",
    "AMD Instinct MI300X VF" -> "mi300x" (a virtual function, as cloud VMs report it, is the same chip)."""
    words = [w for w in device_name.lower().split() if not _NOT_CHIP.match(w)]
    return "-".join(words) or "unknown"


def cache_dir() -> Path:
    """The per-user cache: $TP_OVERLAP_CACHE, else $XDG_CACHE_HOME/tp-overlap, else ~/.cache/tp-overlap."""
    return options.env_cache_dir()


def table_name(kind: str, device_name: str, world: int | None = None) -> str:
    """"dispatch": <device>-tp<W>.json (one per device and world size); "gemm", "decode": <device>.json."""
    if kind == "dispatch":
        return f"{device_key(device_name)}-tp{world}.json"
    if kind in ("gemm", "decode"):
        return f"{device_key(device_name)}.json"
    raise ValueError(f"table kind must be one of {sorted(SHIPPED)}, got {kind!r}")


def cached_path(kind: str, device_name: str, world: int | None = None) -> Path:
    return cache_dir() / kind / table_name(kind, device_name, world)


def shipped_path(kind: str, device_name: str, world: int | None = None) -> Path:
    return SHIPPED[kind] / table_name(kind, device_name, world)


@functools.lru_cache(maxsize=None)
def versions(device: str = "cuda") -> dict:
    """What a measurement depends on besides the device: torch, Triton and the GPU driver. Triton's
    version is read from its package metadata, not by importing it: on the CPU the engine decides on
    TRITON_INTERPRET after looking its table up, and Triton reads that setting when it is imported."""
    import torch
    driver = "none"
    if device != "cpu" and torch.cuda.is_available():
        driver = _driver_version()
    return {"torch": torch.__version__, "triton": _triton_version(), "driver": driver}


def _triton_version() -> str:
    from importlib import metadata
    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    import triton
    return triton.__version__


def _driver_version() -> str:
    """The GPU driver's version as its tool reports it (nvidia-smi, or the HIP runtime's for ROCm
    builds), "unknown" where neither answers."""
    import subprocess

    import torch
    if torch.version.hip is not None:
        return f"hip {torch.version.hip}"
    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        if out:
            return f"nvidia {out[0]} (CUDA runtime {torch.version.cuda})"
    return "unknown"


def tune_command(world: int | None = None, model: str | None = None, fused_ops: str = "auto") -> str:
    """The command that measures a table; with a fused-op design named, that design alone."""
    design = "" if fused_ops == "auto" else f" --fused-ops {fused_ops}"
    return f"tp-overlap tune --tp {world or 'W'} --model {model or 'MODEL'}{design}"


@dataclass
class Found:
    """A table and where it came from ("explicit", "cache", "shipped" or "none"), the start-up log
    line that says so, and the warnings (each to be logged once)."""
    origin: str
    path: Path | None = None
    data: dict | None = None
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.data is None:
            return "none"
        d = self.data
        return (f"{self.origin} table {self.path} (measured {d.get('date', '?')} on {d.get('device', '?')}, "
                f"torch {d.get('torch', '?')}, Triton {d.get('triton', '?')}, driver {d.get('driver', '?')})")


def read_table(path: Path, required: tuple[str, ...]) -> dict:
    """The table at `path`; ValueError naming the file and what is wrong if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON table ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or any(k not in data for k in required):
        missing = [k for k in required if not isinstance(data, dict) or k not in data]
        raise ValueError(f"{path} is not a table: it lacks {missing}")
    return data


def find(kind: str, device_name: str, world: int | None = None, explicit: str | os.PathLike | None = None,
         required: tuple[str, ...] = (), current: dict | None = None, model: str | None = None) -> Found:
    """The table to use, in the lookup order of this module's docstring. `current`: this process's
    versions() (compared with a cached table's); `model`: named in the tune command of warnings."""
    warnings: list[str] = []
    cmd = tune_command(world or 1, model)
    candidates = []
    if explicit is not None:
        candidates.append(("explicit", Path(explicit)))
    candidates += [("cache", cached_path(kind, device_name, world)), ("shipped", shipped_path(kind, device_name, world))]
    for origin, path in candidates:
        if origin != "explicit" and not path.exists():
            continue
        try:
            data = read_table(path, required)
        except ValueError as e:
            warnings.append(f"tp_overlap: skipping the {kind} table: {e}. Falling back to the next one; "
                            f"`{cmd}` measures a new one.")
            continue
        if origin == "cache" and current is not None:
            differ = [f"{k} {data.get(k)} (now {current[k]})" for k in VERSION_KEYS if data.get(k) != current.get(k)]
            if differ:
                warnings.append(f"tp_overlap: the cached {kind} table {path} was measured under other versions "
                                f"({', '.join(differ)}); it may be stale. Run `{cmd}` to measure it again.")
        if origin == "shipped" and data.get("device") != device_name:
            warnings.append(f"tp_overlap: using the shipped {kind} table {path.name}, measured on "
                            f"{data.get('device')}, on a different device ({device_name}). Run `{cmd}` to measure "
                            f"this one.")
        return Found(origin, path, data, warnings)
    return Found("none", None, None, warnings)


def load(kind: str, device_name: str, parse: Callable[[dict], Any], instead: str, *, world: int | None = None,
         explicit: str | os.PathLike | None = None, required: tuple[str, ...] = (), current: dict | None = None,
         model: str | None = None) -> tuple[Any, Found]:
    """A table of `kind` for this device (and world size), as `find` finds it, parsed by `parse`, and
    where it came from. One that does not parse falls back like a missing one: (None, Found "none"),
    its warning added; `instead` says what runs then. The warnings are the caller's to log."""
    found = find(kind, device_name, world, explicit=explicit, required=required, current=current, model=model)
    if found.data is None:
        return None, found
    try:
        return parse(found.data), found
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        found.warnings.append(f"tp_overlap: skipping the {kind} table {found.path}: it does not parse "
                              f"({type(e).__name__}: {e}); {instead}. `{tune_command(world, model)}` measures a "
                              f"new one.")
        return None, Found("none", warnings=found.warnings)


def load_config_table(kind: str, device_name: str, required: tuple[str, ...], parse, instead: str):
    """A config table ("gemm", "decode") for this device (`load`, compared with this process's CUDA
    versions), its warnings logged by rank 0 only: once per start."""
    table, found = load(kind, device_name, parse, instead, required=required, current=versions("cuda"))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        for w in found.warnings:
            log.warning(w)
    return table, found


C = TypeVar("C")
# the fields of a bucketed table's JSON (tuning writes them; extra fields are the kind's own)
BUCKETED_FIELDS = ("buckets", "configs", "entries", "defaults")


@dataclass(frozen=True)
class BucketedTable(Generic[C]):
    """Configs measured per M bucket and (N, K) shape: the GEMM core's tiles (gemm_config.py) and the
    decode matmul's (decode_config.py). In JSON: `buckets` (measured M, ascending), `configs` (label ->
    config fields), `entries` ({M, N, K, label}: the fastest at that shape), `defaults` (bucket -> the
    label of its most frequent winner, for shapes the table lacks)."""
    buckets: tuple[int, ...]
    configs: dict       # (bucket, n, k) -> C
    defaults: dict      # bucket -> C

    @staticmethod
    def fields_of(data: dict, make: Callable[[dict], C]) -> dict:
        """The constructor's fields from the JSON, each config made by `make` from its fields."""
        by_label = {label: make(c) for label, c in data["configs"].items()}
        return {"buckets": tuple(data["buckets"]),
                "configs": {(e["M"], e["N"], e["K"]): by_label[e["label"]] for e in data["entries"]},
                "defaults": {int(m): by_label[label] for m, label in data["defaults"].items()}}

    @classmethod
    def parse(cls, data: dict, make: Callable[[dict], C]) -> "BucketedTable[C]":
        return cls(**cls.fields_of(data, make))

    def bucket(self, m: int) -> int:
        """The smallest measured M >= m (its tiles cover m rows), or the largest."""
        return next((b for b in self.buckets if b >= m), self.buckets[-1])

    def config(self, m: int, n: int, k: int) -> C | None:
        b = self.bucket(m)
        return self.configs.get((b, n, k), self.defaults.get(b))


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path`.lock for a read-modify-write of `path` (two tune runs at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as f:
        try:
            import fcntl
        except ImportError:  # no POSIX locks: writes stay atomic, a concurrent merge may keep one run's rows
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
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


def writable_or_raise(directory: Path) -> None:
    """A clear error, before any measuring, when the cache cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"the tp-overlap cache {directory} is not writable ({e.strerror or e}). Point TP_OVERLAP_CACHE at a "
            f"writable folder (or fix the permissions) and run the command again.") from e
