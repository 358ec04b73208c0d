"""Shared pieces of the GPU benchmarks: timing with device events on every rank, CUDA-graph
capture, and writing results (JSON + markdown) with device and versions."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import torch
import torch.distributed as dist


def time_per_call_ms(fn, *, calls: int = 20, samples: int = 15, group=None) -> float:
    """Median over `samples` of (time for `calls` back-to-back calls) / calls. Ranks start each
    sample together (a host barrier), so one rank's late start does not read as latency. Without a
    process group (single-GPU benchmarks) there is nobody to wait for."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def capture_graph(fn, calls: int):
    """A CUDA graph of `calls` calls to fn; returns a replay function. fn must be warm."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # settle allocations on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def graph_time_per_call_ms(fn, *, calls: int = 20, samples: int = 15, group=None) -> float:
    replay = capture_graph(fn, calls)
    replay()
    torch.cuda.synchronize()
    return time_per_call_ms(replay, calls=1, samples=samples, group=group) / calls


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --tp, --out, --quick."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--quick", action="store_true")
    return p


def environment(tp: int, on_gpu: bool = True, **extra) -> dict:
    import triton
    props = torch.cuda.get_device_properties(0) if on_gpu and torch.cuda.is_available() else None
    return {
        "date": datetime.date.today().isoformat(),
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


def write_results(out_dir: str, name: str, payload: dict, markdown: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    env = payload["environment"]
    stem = os.path.join(out_dir, f"{name}-{device_slug(env)}-{env['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=2)
    header = (f"_{env['device']} x{env['device_count']}, torch {env['torch']}, Triton {env['triton']}, "
              f"{env['date']}. Medians; ratios from the same run._\n\n")
    with open(stem + ".md", "w") as f:
        f.write(header + markdown)
    return stem + ".json", stem + ".md"


def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def grouped_bars(path: str, labels: list[str], series: dict[str, list[float]], ylabel: str,
                 rotation: int = 30) -> str | None:
    """A PNG of bars grouped per label, one colour per series; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(max(7, len(labels) * 0.9), 4.5))
    width = 0.8 / max(len(series), 1)
    for j, (name, values) in enumerate(series.items()):
        offset = (j - (len(series) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(values))], values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=rotation, ha="right" if rotation else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
