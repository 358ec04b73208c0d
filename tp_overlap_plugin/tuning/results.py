"""How measurements are written: the environment they ran in (device, versions), JSON + a markdown
table per run, and the table format of the markdown."""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch


def environment(tp: int, on_gpu: bool = True, **extra) -> dict:
    import triton
    props = torch.cuda.get_device_properties(0) if on_gpu and torch.cuda.is_available() else None
    return {
        "date": datetime.date.today().isoformat(),
        # the date alone cannot order two runs of one day (bench/readme_table.py takes the newest)
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "tp": tp,
        "device": props.name if props else "cpu",
        "device_count": torch.cuda.device_count() if props else 0,
        "sm_count": props.multi_processor_count if props else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "host": platform.node(),
        **extra,
    }


def device_slug(env: dict) -> str:
    name = env["device"].replace("NVIDIA ", "").replace(" ", "-").lower()
    return f"{name}x{env['device_count']}" if env["device_count"] > 1 else name


def write_results(out_dir: str, name: str, payload: dict, markdown: str, compact: bool = False) -> tuple[str, str]:
    """compact: JSON on one line (a payload of thousands of records, e.g. a step timeline)."""
    os.makedirs(out_dir, exist_ok=True)
    env = payload["environment"]
    stem = os.path.join(out_dir, f"{name}-{device_slug(env)}-{env['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, **({"separators": (",", ":")} if compact else {"indent": 2}))
    with open(stem + ".md", "w") as f:
        f.write(header(env) + markdown)
    return stem + ".json", stem + ".md"


def header(env: dict) -> str:
    return (f"_{env['device']} x{env['device_count']}, torch {env['torch']}, Triton {env['triton']}, "
            f"{env['date']}. Medians; ratios from the same run._\n\n")


def publish(out_dir: str, name: str, payload: dict, markdown: str) -> tuple[str, str]:
    """write_results, then the tables and where they went on stdout (the device machines' log)."""
    paths = write_results(out_dir, name, payload, markdown)
    print(markdown)
    print("wrote", *paths)
    return paths


def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None
