"""The measurement store of `tp-overlap tune`: per device and TP size, one JSON file per phase, its rows
keyed by shape, under the environment (device, versions) they were measured in. A run cut off keeps
what it finished; rows measured under other versions are measured again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tp_overlap_plugin import files, tables


# one GPU's measurements, for a config table per device that every TP size's shapes go into
DEVICE_PHASES = ("gemm_configs", "decode_configs")


def store_dir(device_name: str, world: int, phase: str | None = None) -> Path:
    """Where a phase's rows are kept: per device and TP size, except DEVICE_PHASES' (per device)."""
    if phase in DEVICE_PHASES:
        return tables.cache_dir() / "measurements" / tables.device_key(device_name)
    return tables.cache_dir() / "measurements" / f"{tables.device_key(device_name)}-tp{world}"


def _same_versions(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("device",) + tables.VERSION_KEYS)


def load_rows(directory: Path, phase: str, env: dict) -> dict:
    """The rows of `phase` measured under `env`'s device and versions ({} for others, or a file that
    does not parse: both are measured again)."""
    path = directory / f"{phase}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"tp-overlap tune: ignoring {path} ({type(e).__name__}: {e}); measuring its rows again",
              file=sys.stderr)
        return {}
    if not isinstance(data, dict) or not _same_versions(data.get("environment", {}), env):
        return {}
    return data.get("rows", {})


def save_rows(directory: Path, phase: str, env: dict, rows: dict, extra: dict | None = None) -> None:
    """Merge `rows` into the phase's file, under its lock, atomically (a concurrent run's rows stay;
    rows of other versions, or a file that does not parse, are replaced)."""
    path = directory / f"{phase}.json"
    with files.locked(path):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        if not isinstance(old, dict) or not _same_versions(old.get("environment", {}), env):
            old = {}
        data = {**old, **(extra or {}), "environment": env, "rows": {**old.get("rows", {}), **rows}}
        files.write_atomic(path, json.dumps(data, indent=1))




def load_phase(device_name: str, world: int, phase: str) -> dict | None:
    """A phase's file as stored (its environment, rows and extras, whatever versions measured them);
    None where there is none or it does not parse."""
    path = store_dir(device_name, world, phase) / f"{phase}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"tp-overlap tune: skipping {path}: {e}", file=sys.stderr)
        return None
    return data if isinstance(data, dict) and isinstance(data.get("rows"), dict) else None


def environment(plan) -> dict:
    """The store's environment of this rank's measurements: the run's, and the versions they depend on."""
    from tp_overlap_plugin.tuning import results
    env = results.environment(plan.world, on_gpu=plan.device == "cuda", model=plan.model)
    env.update(tables.versions(plan.device))
    return env
