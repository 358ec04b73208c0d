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

This package alone opens table files (integration_tests/test_tables.py holds every other module to
that). The kinds are declared once, in kinds.py: each with its sections, its fields and the one
version header (device, versions, date, the command that measures it again), its `parse` and the one
serialiser. `load` is the one loader of all three: it finds a table in that order and parses it, and
one that does not parse falls back like a missing one. `read` gives a table's plain data (tune's
engine check), `write` is the one writer: of plain data that tuning's builders make (rules.build,
gemm_configs.build_table, decode_configs.build_table), checked against its kind, serialised, written
atomically (a temporary file in the same folder, then os.replace) under a lock file, so two `tune`
runs at once leave one valid file. The GEMM and decode tables are both a `BucketedTable`
(bucketed.py): per measured M bucket and (N, K) shape the fastest config, per bucket the most frequent
winner.
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
from typing import Any, Callable

from tp_overlap_plugin import files, options
from tp_overlap_plugin.tables.bucketed import BUCKETED_FIELDS, BucketedTable, GemmTable
from tp_overlap_plugin.tables.kinds import DECODE, DISPATCH, GEMM, HEADER, KINDS, VERSION_KEYS, Kind, kind_named

__all__ = ["BUCKETED_FIELDS", "BucketedTable", "DECODE", "DISPATCH", "Found", "GEMM", "GemmTable", "HEADER", "KINDS",
           "Kind", "VERSION_KEYS", "cache_dir", "cached_path", "device_key", "find", "kind_named", "load", "load_config_table",
           "read", "shipped_path", "table_name", "tune_command", "versions", "writable_or_raise", "write"]

log = logging.getLogger(__name__)
PACKAGE_DIR = Path(__file__).parent.parent
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
    return kind_named(kind).file_name(device_key(device_name), world)


def cached_path(kind: str, device_name: str, world: int | None = None) -> Path:
    return cache_dir() / kind / table_name(kind, device_name, world)


def shipped_path(kind: str, device_name: str, world: int | None = None) -> Path:
    return PACKAGE_DIR / KINDS[kind].folder / table_name(kind, device_name, world)


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


def tune_command(world: int | None = None, model: str | None = None, fused_ops: str = "auto", *,
                 shapes: str = "model") -> str:
    """The command that measures a table; with a fused-op design named, that design alone. `shapes`
    "shipped": the config tables of every shipped model's shapes (what gemm_tables/ and decode_tables/
    ship), the ranks (`--tp`) sharing the work out."""
    if shapes == "shipped":
        return f"tp-overlap tune --tp {world or 1} --shapes shipped"
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


def _read(path: Path, k: Kind) -> dict:
    """The table of kind `k` at `path`; ValueError naming the file and what is wrong if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON table ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or any(f not in data for f in k.fields):
        missing = [f for f in k.fields if not isinstance(data, dict) or f not in data]
        raise ValueError(f"{path} is not a table: it lacks {missing}")
    return data


def find(kind: str, device_name: str, world: int | None = None, explicit: str | os.PathLike | None = None,
         current: dict | None = None, model: str | None = None) -> Found:
    """The table to use, in the lookup order of this module's docstring. `current`: this process's
    versions() (compared with a cached table's); `model`: named in the tune command of warnings."""
    k = kind_named(kind)
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
            data = _read(path, k)
        except ValueError as e:
            warnings.append(f"tp_overlap: skipping the {kind} table: {e}. Falling back to the next one; "
                            f"`{cmd}` measures a new one.")
            continue
        if origin == "cache" and current is not None:
            differ = [f"{v} {data.get(v)} (now {current[v]})" for v in VERSION_KEYS if data.get(v) != current.get(v)]
            if differ:
                warnings.append(f"tp_overlap: the cached {kind} table {path} was measured under other versions "
                                f"({', '.join(differ)}); it may be stale. Run `{cmd}` to measure it again.")
        if origin == "shipped" and data.get("device") != device_name:
            warnings.append(f"tp_overlap: using the shipped {kind} table {path.name}, measured on "
                            f"{data.get('device')}, on a different device ({device_name}). Run `{cmd}` to measure "
                            f"this one.")
        return Found(origin, path, data, warnings)
    return Found("none", None, None, warnings)


def load(kind: str, device_name: str, instead: str, *, make: Callable[[dict], Any] | None = None,
         world: int | None = None, explicit: str | os.PathLike | None = None, current: dict | None = None,
         model: str | None = None) -> tuple[Any, Found]:
    """A table of `kind` for this device (and world size), as `find` finds it, parsed by its kind (each
    config made by `make`), and where it came from. One that does not parse falls back like a missing
    one: (None, Found "none"), its warning added; `instead` says what runs then. The warnings are the
    caller's to log."""
    found = find(kind, device_name, world, explicit=explicit, current=current, model=model)
    if found.data is None:
        return None, found
    try:
        return KINDS[kind].parse(found.data, make), found
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        found.warnings.append(f"tp_overlap: skipping the {kind} table {found.path}: it does not parse "
                              f"({type(e).__name__}: {e}); {instead}. `{tune_command(world, model)}` measures a "
                              f"new one.")
        return None, Found("none", warnings=found.warnings)


def load_config_table(kind: str, device_name: str, make: Callable[[dict], Any], instead: str):
    """A config table ("gemm", "decode") for this device (`load`, compared with this process's CUDA
    versions), its warnings logged by rank 0 only: once per start."""
    table, found = load(kind, device_name, instead, make=make, current=versions("cuda"))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        for w in found.warnings:
            log.warning(w)
    return table, found


def read(kind: str, device_name: str | None = None, world: int | None = None, *,
         path: str | os.PathLike | None = None) -> dict | None:
    """A table's plain data: the one at `path`, else this device's (and world size's) in the cache;
    None where there is none, ValueError where the file is not a table of the kind."""
    path = Path(path) if path is not None else cached_path(kind, device_name, world)
    if not path.exists():
        return None
    return _read(path, kind_named(kind))


def write(kind: str, device_name: str, world: int | None, table: dict, *,
          path: str | os.PathLike | None = None) -> Path:
    """The one writer of tables: `table` (plain data, as tuning's builders make it) into the cache as
    this device's (and world size's), or to `path` (a copy tune's engine check runs on). ValueError,
    before anything is written, where it lacks the header or does not parse as its kind. Serialised
    by the kind, under the file's lock, atomically. Returns the path."""
    k = kind_named(kind)
    k.check(table, device_name, world if k.per_world else None)
    path = Path(path) if path is not None else cached_path(kind, device_name, world)
    with files.locked(path):
        files.write_atomic(path, k.dump(table))
    return path


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
