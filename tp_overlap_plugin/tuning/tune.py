"""`tp-overlap tune`: measure what the dispatcher and the GEMM core consult, on this machine, for this
TP size and this model, and cache the tables (tp_overlap_plugin/tables.py says where and how they are
found again).

It starts W ranks (multirank.run_ranks) and runs the phases in order:

  gemm_configs  the GEMM core's candidate configs against cuBLAS on the model's shard shapes (each
                rank a share of the shapes, one GPU each)       -> the GEMM config table
  gemv          our GEMV against F.linear at the decode row counts (shared out likewise)
  all_reduce    ours (one-shot, two-shot) against NCCL/RCCL from 8 KB up, eager and in CUDA graphs,
                and the fused all-reduce + residual add + RMSNorm at the model's hidden size
  fused_ops     AG-GEMM / GEMM-RS against the sequential collective + GEMM over an M sweep
  gemm_ar       GEMM + all-reduce against F.linear + an all-reduce (the decode row layers)
                                                                -> the dispatch table
(the last three need W >= 2). Every row is timed in interleaved repeats (stock, ours, stock, ours,
...), and the rules (tuning/rules.py) pick ours only where it won by the table's margin in every
repeat; the evidence (markdown, and a PNG where matplotlib is installed) shows each ratio with its
spread.

Measurements are stored row by row in the cache (`measurements/`), keyed by shape, so a run cut off
(Ctrl-C, the time budget) keeps what it finished and the next run resumes from there (`--force`
measures everything again), and the tables hold the rows of every model tuned on this device and
TP size. Measurements taken under other versions (torch, Triton, driver) are measured again.
"""

from __future__ import annotations

import sys
import time

from tp_overlap_plugin import tables
from tp_overlap_plugin.tuning.plan import Plan, heap_bytes, make_plan, plan_candidates
from tp_overlap_plugin.tuning.phases import tune_rank
from tp_overlap_plugin.tuning.report import build_tables
from tp_overlap_plugin.tuning.shapes import ModelDims
from tp_overlap_plugin.tuning.store import load_rows, store_dir


def run(model: str, dims: ModelDims, world: int, device: str, quick: bool = False, budget_min: float | None = None,
        force: bool = False, margin: float | None = None, timeout_s: float | None = None) -> int:
    from tp_overlap_plugin.multirank import run_ranks
    from tp_overlap_plugin.tuning import rules
    cache = tables.cache_dir()
    plan = make_plan(model, dims, world, device, quick, rules.MARGIN if margin is None else margin)
    budget_s = 60 * (budget_min if budget_min is not None else (3 if quick else 10))
    total = sum(len(v) for v in plan.items.values())
    print(f"tp-overlap tune: {model} at TP={world} on {device}{' (quick)' if quick else ''}: {total} rows in "
          f"{len(plan.items)} phases, estimated {plan.estimate_s() / 60:.1f} min (budget {budget_s / 60:.0f} min); "
          f"cache {cache}" + ("; --force: measuring everything again" if force else
                              "; rows measured before under these versions are kept"), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    device_name = _device_name(device)
    if not force and not _todo(plan, device_name):
        print("tp-overlap tune: every row is measured already (--force measures them again)", file=sys.stderr)
        return _finish(plan, device_name, None, None, t0)
    crashed = _preflight(plan) if device == "cuda" and plan.items.get("gemm_configs") else {}
    interrupted = None
    summary = None
    try:
        per_rank = run_ranks(tune_rank, world, (plan, time.time() + budget_s - (time.monotonic() - t0), force,
                                                crashed, str(cache)),
                             device=device, heap_size=heap_bytes(plan) if world > 1 else None,
                             timeout=timeout_s or max(600.0, 3 * budget_s))
        summary = per_rank[0]
    except KeyboardInterrupt:
        interrupted = "interrupted (Ctrl-C)"
    except Exception as e:  # a rank failed (Ctrl-C reaches the ranks too): what finished before is kept
        interrupted = ("interrupted (Ctrl-C)" if "KeyboardInterrupt" in str(e)
                       else f"a rank failed: {str(e)[-2000:]}")
    return _finish(plan, summary["environment"]["device"] if summary else device_name, summary, interrupted, t0)


def _todo(plan: Plan, device_name: str) -> int:
    """How many of the plan's rows the store lacks (under this process's versions)."""
    env = {"device": device_name, **tables.versions(plan.device)}
    return sum(len([it for it in items if it["key"] not in load_rows(store_dir(device_name, plan.world, phase), phase, env)])
               for phase, items in plan.items.items())


def _finish(plan: Plan, device_name: str, summary: dict | None, interrupted: str | None, t0: float) -> int:
    world, model = plan.world, plan.model
    paths = build_tables(device_name, world, plan)
    for name, p in paths.items():
        print(f"  {name}: {p}", file=sys.stderr)
    if summary:
        for phase, s in summary["phases"].items():
            note = f"; stopped: {s['stopped']}" if s["stopped"] else ""
            print(f"  {phase}: {s['measured']} measured, {s['resumed']} kept from before, of {s['items']}{note}",
                  file=sys.stderr)
    took = time.monotonic() - t0
    if interrupted:
        print(f"tp-overlap tune: {interrupted} after {took:.0f} s; the rows measured so far are kept in the cache, "
              f"and `tp-overlap tune --tp {world} --model {model}` resumes from there.", file=sys.stderr)
        return 130 if interrupted.startswith("interrupted") else 1
    stopped = summary is not None and any(s["stopped"] for s in summary["phases"].values())
    print(f"tp-overlap tune: done in {took:.0f} s" + (" (budget reached: run it again to measure the rest)"
                                                     if stopped else "") + f". `tp-overlap serve --tp {world} "
          f"--model {model} --tp-overlap` now uses these tables.", file=sys.stderr)
    return 0


def _device_name(device: str) -> str:
    """This machine's device name, asked in a child process: the ranks measure without a CUDA context
    of this process's on GPU 0 beside them."""
    if device == "cpu":
        return "cpu"
    import subprocess
    code = "import torch; print(torch.cuda.get_device_name(0))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _preflight(plan: Plan) -> dict:
    """Each candidate config once, in child processes (one that takes its CUDA context down is left out
    of the sweep, not the run down with it); run before the ranks start."""
    from tp_overlap_plugin.tuning import gemm_configs as gc
    large, small = plan_candidates(plan)
    log: list[str] = []
    t0 = time.monotonic()
    crashed = gc.preflight_all(large + small, log, workers=4)
    print(f"tp-overlap tune: compiled and checked {len(large + small)} GEMM configs in {time.monotonic() - t0:.0f} s"
          + (f"; left out: {sorted(crashed)}" if crashed else ""), file=sys.stderr, flush=True)
    return crashed
