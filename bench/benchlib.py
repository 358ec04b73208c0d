"""Shared pieces of the GPU benchmarks: the timers and the results' format (both from the package's
tp_overlap_plugin/tuning, which `tp-overlap tune` measures with), the options every script takes, and
the statistics and charts of interleaved stock-vs-flag comparisons (e2e.py, serve_load.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from tp_overlap_plugin.tuning.results import (device_slug, environment, md_table, publish,  # noqa: F401
                                              write_results)
from tp_overlap_plugin.tuning.results import pyplot as _pyplot
from tp_overlap_plugin.tuning.timing import hbm_copy_bandwidth, time_per_call_ms  # noqa: F401


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --tp, --out, --quick."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--quick", action="store_true")
    return p


def add_share_gpus_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--share-gpus", action="store_true",
                   help="more ranks than GPUs (run_ranks(share_gpus=True)): ranks on one GPU are time-sliced, so "
                        "the run checks correctness only")


def ranks_share_gpus(tp: int, share_gpus: bool, on_gpu: bool = True) -> bool:
    return on_gpu and share_gpus and torch.cuda.device_count() < tp


def shared_gpus_banner(tp: int) -> str:
    """The first line of a result whose ranks shared GPUs: its seconds are no timings."""
    return (f"**{tp} ranks on {torch.cuda.device_count()} GPUs** (time-sliced: a correctness check, the seconds "
            f"are not timings)\n\n")


def environment_probe(tp: int, on_gpu: bool = True, **extra) -> dict:
    """environment(), computed in a short-lived child process: a benchmark that starts engine processes
    must not hold a CUDA context of its own on GPU 0 while they run."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from benchlib import environment; "
            "print(json.dumps(environment(int(sys.argv[2]), sys.argv[3] == '1')))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), str(tp),
                          "1" if on_gpu else "0"], check=True, capture_output=True, text=True).stdout
    return {**json.loads(out.strip().splitlines()[-1]), **extra}


def dispatch_table_warning(env: dict, dispatch: str) -> str | None:
    """A loud line when the flag's `table` mode has no table for this device and TP size (none cached,
    none shipped): then every op takes the stock path and a comparison measures stock against stock."""
    if env["tp"] < 2 or dispatch != "table":
        return None
    from tp_overlap_plugin import tables
    found = tables.find("dispatch", env["device"], env["tp"])
    if found.data is not None:
        return None
    return (f"NO DISPATCH TABLE for {env['device']} at TP={env['tp']} ({tables.table_name('dispatch', env['device'], env['tp'])} "
            f"is neither cached nor shipped): with dispatch 'table' the flag runs the stock path for every op, so these "
            f"ratios compare stock with stock. Measure one first (`{tables.tune_command(env['tp'], env.get('model'))}`) "
            f"or pass --dispatch overlap.")


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout` around the benchmark) unwinds like Ctrl-C: servers started in their own
    session are stopped on the way out instead of being left holding the GPUs."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)


def load_payload(path: str) -> tuple[dict, str]:
    """A comparison's JSON and the folder it is in, to redraw its markdown and PNG elsewhere than where it
    ran (the GPU machines have no matplotlib)."""
    with open(path) as f:
        return json.load(f), os.path.dirname(os.path.abspath(path))


def shout(line: str) -> None:
    bar = "!" * min(len(line), 100)
    print(f"\n{bar}\n{line}\n{bar}\n", flush=True)


def report(payload: dict, markdown: str, paths) -> None:
    """The end of a comparison: the warnings again (the log above them is long), the tables, the files."""
    for w in payload["warnings"]:
        shout(w)
    print(markdown)
    print("wrote", *paths)


_T0 = time.monotonic()


def log(tag: str, msg: str) -> None:
    """A progress line with the time since the script started: a run cut off by a time limit still
    tells how far it got and how long each part took."""
    print(f"[{tag} +{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def grouped_bars(path: str, labels: list[str], series: dict[str, list[float]], ylabel: str,
                 rotation: int = 30) -> str | None:
    """A PNG of bars grouped per label, one colour per series; None without matplotlib."""
    plt = _pyplot()
    if plt is None:
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


MIN_PAIRS = 3


def add_comparison_args(p: argparse.ArgumentParser) -> None:
    """The options of a stock-vs-flag comparison (e2e.py, serve_load.py)."""
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dispatch", default="table", choices=["table", "overlap"],
                   help="table: what users get (the shipped table for this device and TP); overlap: our kernels "
                        "everywhere")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "kernel", "chunked"],
                   help="the sharded layout's AG-GEMM / GEMM-RS (tp_overlap.fused_ops; auto: the table's design)")
    p.add_argument("--pairs", type=int, default=MIN_PAIRS, help=f"A B pairs (fewer than {MIN_PAIRS}: no win/loss call)")
    p.add_argument("--order", default="stock,overlap", help="which engine is A, the first of each pair")
    p.add_argument("--tag", default="", help="appended to the results' name")
    p.add_argument("--replot", metavar="JSON", help="only rewrite the markdown and PNG of this results file")


def start_comparison(kind: str, schema: str, args, on_gpu: bool = True) -> tuple[dict, tuple[str, ...], str]:
    """Checks the options, probes the machine and says loudly what would make the ratios mean less
    (too few pairs, no dispatch table). Returns the results' skeleton, the engines in pair order and
    the results' name."""
    # At TP=1 too: the flag then builds no heap and its layers take the decode matmul where the
    # table's rows say so (issue 28).
    engines = tuple(args.order.split(","))
    if sorted(engines) != ["overlap", "stock"]:
        raise SystemExit(f"--order must name stock and overlap once each, got {args.order!r}")
    if args.pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    env = environment_probe(args.tp, on_gpu, model=args.model, dispatch=args.dispatch)
    warnings = []
    if args.pairs < MIN_PAIRS:
        warnings.append(f"only {args.pairs} pair(s): fewer than {MIN_PAIRS}, so nothing is called a win or a loss.")
    no_table = dispatch_table_warning(env, args.dispatch)
    if no_table:
        warnings.append(no_table)
    for w in warnings:
        shout(w)
    from tp_overlap_plugin import tables
    found = tables.find("dispatch", env["device"], args.tp)
    config = {"model": args.model, "tp": args.tp, "dispatch": args.dispatch, "engines": list(engines),
              "dispatch_table": None if no_table or args.dispatch != "table"
              else (found.path.name if found.origin == "shipped" else str(found.path)),
              "pairs": args.pairs, "quick": args.quick, "fused_ops": getattr(args, "fused_ops", "kernel")}
    # "interleaved": not to overwrite a same-day result of the scripts before them
    name = f"{kind}-interleaved-{args.model}-tp{args.tp}" + ("-overlap-first" if engines[0] == "overlap" else "") + \
        (f"-{args.tag}" if args.tag else "")
    payload = {"schema": schema, "name": name, "environment": env, "config": config, "warnings": warnings,
               "runs": [], "summary": {}}
    return payload, engines, name


def interleaved(engines: tuple[str, ...], pairs: int) -> list[tuple[int, str]]:
    """(pair, engine) in run order, A B A B ...: a drift of the machine over the run (clocks, other
    tenants) lands on both engines instead of on whichever ran second."""
    return [(i, e) for i in range(pairs) for e in engines]


def by_pair(runs: list[dict], engines: tuple[str, ...], field: str, key: str
            ) -> tuple[dict[str, list[dict]], tuple[list[dict], list[dict]]]:
    """Each engine's results for `key` (a scenario, a rate) in pair order, and the stock and flag results
    of the pairs where both have one (a run cut short leaves its pair out of the ratios)."""
    per = {e: {r["pair"]: r[field][key] for r in runs if r["engine"] == e and key in r[field]} for e in engines}
    both = sorted(set(per["stock"]) & set(per["overlap"])) if len(engines) == 2 else []
    return ({e: [per[e][p] for p in sorted(per[e])] for e in engines},
            ([per["stock"][p] for p in both], [per["overlap"][p] for p in both]))


def pair_ratios(base: list[float], flag: list[float]) -> dict:
    """flag/base per pair (higher is better for the flag), their median, min-max and spread, and the
    call: a win or a loss only when every pair agrees and there are at least MIN_PAIRS pairs."""
    ratios = [f / b for b, f in zip(base, flag) if b > 0]
    if not ratios:
        return {"ratios": [], "pairs": 0, "call": "no pairs"}
    lo, hi = min(ratios), max(ratios)
    if len(ratios) < MIN_PAIRS:
        call = f"no call ({len(ratios)} pair{'s' if len(ratios) > 1 else ''} < {MIN_PAIRS})"
    elif lo > 1:
        call = "win"
    elif hi < 1:
        call = "loss"
    else:
        call = "no call (pairs disagree)"
    return {"ratios": ratios, "pairs": len(ratios), "median": statistics.median(ratios), "min": lo, "max": hi,
            "spread": hi / lo, "call": call}


def comparison_header(script: str, payload: dict) -> list[str]:
    """The markdown's first lines: the loud warnings, then what was compared, how often and how (the
    payload's `method`, a sentence that the JSON keeps too)."""
    cfg, how = payload["config"], payload["method"]
    engines = cfg["engines"]
    table = f" (table {cfg['dispatch_table']})" if cfg.get("dispatch_table") else ""
    runs = (f"{cfg['pairs']} pair(s), run {' '.join(e.upper() for e in engines)} ... alternately"
            if len(engines) == 2 else f"{cfg['pairs']} run(s)")
    return [f"**{w}**\n" for w in payload["warnings"]] + [
        f"`{script}`, {cfg['model']}, TP={cfg['tp']}, dispatch `{cfg['dispatch']}`{table}; {runs}, each in "
        f"fresh processes. {how}\n"]


def slowest_rank(rows: list[dict]) -> dict:
    """One result row from every rank's row of it: each timing (a float that is not a `*rel_err`) the
    slowest rank's, since a collective op ends when its last rank does; the rest rank 0's."""
    out = dict(rows[0])
    for key, v in out.items():
        if isinstance(v, float) and not key.endswith("rel_err"):
            out[key] = max(r.get(key, v) for r in rows)
    return out


def median_or_nan(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def fmt_ratio(r: dict) -> str:
    if not r.get("ratios"):
        return "-"
    return f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]"


def ratio_chart(path: str, labels: list[str], ratios: list[dict], ylabel: str, title: str = "",
                curves: dict[str, list[tuple[float, float]]] | None = None, curve_labels: tuple[str, str] = ("", ""),
                curve_styles: dict[str, str] | None = None) -> str | None:
    """A PNG: the median ratio per label with its min-max over the pairs as error bars, and beside it,
    given `curves` ({series: [(x, y), ...]}, matplotlib format strings in `curve_styles`), a line per
    series (the latency-throughput curve of an HTTP sweep). None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else max(6, len(labels) * 1.2), 4.5),
                             squeeze=False)
    ax = axes[0][0]
    xs = [i for i, r in enumerate(ratios) if r.get("ratios")]
    med = [ratios[i]["median"] for i in xs]
    err = [[ratios[i]["median"] - ratios[i]["min"] for i in xs], [ratios[i]["max"] - ratios[i]["median"] for i in xs]]
    colors = ["tab:green" if ratios[i]["call"] == "win" else "tab:red" if ratios[i]["call"] == "loss" else "tab:gray"
              for i in xs]
    ax.bar(xs, [m - 1 for m in med], bottom=1, color=colors, alpha=0.6)
    ax.errorbar(xs, med, yerr=err, fmt="o", color="black", capsize=5)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if xs:  # keep 1.0 (a tie) in view however far off the ratios are
        lo = min(1.0, *(ratios[i]["min"] for i in xs))
        hi = max(1.0, *(ratios[i]["max"] for i in xs))
        pad = 0.1 * (hi - lo) + 0.005
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title or "median over pairs, bars: min-max (green win, red loss, grey no call)", fontsize=9)
    if curves:
        ax2 = axes[0][1]
        for name, pts in curves.items():
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], (curve_styles or {}).get(name, "o-"), label=name)
        ax2.set_xlabel(curve_labels[0])
        ax2.set_ylabel(curve_labels[1])
        ax2.legend()
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
