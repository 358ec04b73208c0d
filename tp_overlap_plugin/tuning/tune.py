"""`tp-overlap tune`: measure what the dispatcher and the GEMM core consult, on this machine, for this
TP size and this model, and cache the tables (tp_overlap_plugin/tables/ says where and how they are
found again).

It starts W ranks (multirank.run_ranks) and runs the phases in order:

  gemm_configs  the GEMM core's candidate configs against cuBLAS on the model's shard shapes (each
                rank a share of the shapes, one GPU each)       -> the GEMM config table
  decode_configs  the decode matmul's candidate configs against F.linear (shared out likewise)
                                                                -> the decode config table
  gemv          our GEMV (the config its table picks) against F.linear at the decode row counts
  silu_mul      gate_up with SiLU-mul in our GEMM's epilogue against cuBLAS + the SiLU-mul kernel
  all_reduce    ours (one-shot, two-shot) against NCCL/RCCL from 8 KB up, eager and in CUDA graphs,
                and the fused all-reduce + residual add + RMSNorm at the model's hidden size
  fused_ops     AG-GEMM / GEMM-RS against the sequential collective + GEMM over an M sweep
  gemm_ar       GEMM + all-reduce against F.linear + an all-reduce (the decode row layers), and with
                the residual add + RMSNorm after it
                                                                -> the dispatch table
(the last three need W >= 2). Every row is timed in interleaved repeats (stock, ours, stock, ours,
...), and the rules (tuning/rules.py) pick ours only where it won by the table's margin in every
repeat. Then, on those tables, the engine's verdict (tuning/engine_check.py, W ranks again): whole
engine steps, stock against the flag, per step size; where the flag's step does not win by its
margin, that step size runs stock (or the flag's ops in the replicated layout, where those win)
-> the dispatch table's "engine" rows. The evidence (markdown, and a PNG where matplotlib is
installed) shows each ratio with its spread, and the run's wall time per phase.

`--shapes shipped` (plan.shipped_plan) runs the two config phases alone, on the shard shapes of every
model config shipped with the engine at TP = 1, 2, 4, 8, the W ranks sharing the rows out: the config
tables are per device, and the command they name regenerates the shipped ones. No dispatch table.

Measurements are stored row by row in the cache (`measurements/`), keyed by shape, so a run cut off
(Ctrl-C, the time budget) keeps what it finished and the next run resumes from there (`--force`
measures everything again), and the tables hold the rows of every model tuned on this device and
TP size. Measurements taken under other versions (torch, Triton, driver) are measured again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

from tp_overlap_plugin import tables
from tp_overlap_plugin.tuning import engine_check
from tp_overlap_plugin.tuning.plan import PHASES, Plan, heap_bytes, make_plan, plan_candidates, shipped_plan
from tp_overlap_plugin.tuning.phases import clear_marks, marked, tune_rank
from tp_overlap_plugin.tuning.report import build_tables, design_tables
from tp_overlap_plugin.shapes import ModelDims
from tp_overlap_plugin.tuning.store import load_rows, save_rows, store_dir


def run(model: str | None, dims: ModelDims | None, world: int, device: str, quick: bool = False,
        budget_min: float | None = None, force: bool = False, margin: float | None = None,
        timeout_s: float | None = None, *, engine_margin: float | None = None, model_spec: str | None = None,
        step_budget: int | None = None, only: tuple[str, ...] | None = None, fused_ops: str = "auto",
        shapes: str = "model") -> int:
    """`margin` sets the engine check's margin too, unless `engine_margin` is given. `only`: the phases
    to measure (plan.ONLY_CHOICES), the others' stored rows kept; the tables are built from every stored
    row either way. `fused_ops`: the AG-GEMM / GEMM-RS designs measured ("auto": every one, the verdict
    choosing; or one: plan.make_plan). `shapes` "shipped": the config tables' phases on every shipped
    model's shapes (plan.shipped_plan; `model` and `dims` unused), shared out over `world` ranks."""
    from tp_overlap_plugin.tuning import rules
    cache = tables.cache_dir()
    if engine_margin is None:
        engine_margin = rules.ENGINE_MARGIN if margin is None else margin
    margin = rules.MARGIN if margin is None else margin
    plan = (shipped_plan(world, device, quick, margin, engine_margin) if shapes == "shipped" else
            make_plan(model, dims, world, device, quick, margin, engine_margin, model_spec, step_budget, fused_ops))
    if only:
        plan = dataclasses.replace(plan, items={p: v for p, v in plan.items.items() if p in only})
    budget_s = 60 * (budget_min if budget_min is not None else (3 if quick else 10))
    total = sum(len(v) for v in plan.items.values())
    print(f"tp-overlap tune: {plan.describe()} on {device}{' (quick)' if quick else ''}: {total} rows in "
          f"{len(plan.items)} phases, estimated {plan.estimate_s() / 60:.1f} min (budget {budget_s / 60:.0f} min); "
          f"cache {cache}" + ("; --force: measuring everything again" if force else
                              "; rows measured before under these versions are kept"), file=sys.stderr, flush=True)
    if plan.estimate_s() > budget_s:
        print(f"tp-overlap tune: the estimate is over the budget: the run stops starting new rows at "
              f"{budget_s / 60:.0f} min and keeps what it measured (a rerun resumes); `--budget-min "
              f"{math.ceil(1.2 * plan.estimate_s() / 60)}` measures them all in one run", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    deadline = time.time() + budget_s
    timeout = timeout_s or max(600.0, 3 * budget_s)
    device_name = _device_name(device)
    summary = {"phases": {}}
    interrupted = None
    ops_todo = force or _todo(plan, device_name)
    if ops_todo:
        # the measuring phases leave the engine check its estimated time within the budget
        ops_deadline = deadline - plan.phase_estimates_s().get("engine", 0.0)
        crashed, died = _preflight(plan, summary), {}
        while True:
            clear_marks(cache)
            got, interrupted = _ranks(tune_rank, plan, (plan, ops_deadline, force, crashed, str(cache), died),
                                      timeout, heap_bytes(plan) if world > 1 else None)
            # a rank that died took the run down: the rows it was measuring are recorded as failed (they
            # run stock), and the ranks start again on the rest (the rows kept so far stay measured)
            dead = {} if got is not None or interrupted.startswith("interrupted") else marked(cache)
            if not dead or len(died) >= MAX_DEAD_ROWS or set(dead) <= set(died):
                break
            why = interrupted.strip().splitlines()[-1][-300:] if interrupted.strip() else "a rank died"
            died.update({name: f"a rank died measuring it ({why})" for name in dead})
            print(f"tp-overlap tune: a rank died measuring {', '.join(sorted(dead))}: recorded as failed (stock); "
                  f"starting the ranks again for the rest", file=sys.stderr, flush=True)
        clear_marks(cache)
        if got is not None:
            summary["phases"].update(got["phases"])
            device_name = got["environment"]["device"]
    build_tables(device_name, world, plan)  # the flag's engine runs on these
    engine_todo = None
    if interrupted is None and plan.items.get("engine"):
        designs = design_tables(device_name, world, plan)
        engine_todo = _engine_todo(plan, device_name, designs, force)
        if engine_todo:
            interrupted = _engine(plan, device_name, designs, engine_todo, deadline, timeout, summary)
    if not ops_todo and not engine_todo:
        print("tp-overlap tune: every row is measured already (--force measures them again)", file=sys.stderr)
    return _finish(plan, device_name, summary, interrupted, t0)


def _ranks(fn, plan: Plan, args: tuple, timeout: float, heap_size: int | None):
    """run_ranks(fn) over the plan's world: (rank 0's result, None), or (None, why it stopped); what the
    ranks stored before is kept either way."""
    from tp_overlap_plugin.multirank import run_ranks
    try:
        return run_ranks(fn, plan.world, args, device=plan.device, heap_size=heap_size, timeout=timeout)[0], None
    except KeyboardInterrupt:
        return None, "interrupted (Ctrl-C)"
    except Exception as e:  # a rank failed (Ctrl-C reaches the ranks too): what finished before is kept
        return None, ("interrupted (Ctrl-C)" if "KeyboardInterrupt" in str(e) else f"a rank failed: {str(e)[-2000:]}")


# rows a run records as failed because a rank died measuring them before it gives up altogether
MAX_DEAD_ROWS = 3


def _todo(plan: Plan, device_name: str) -> int:
    """How many of the plan's rows of the measuring phases the store lacks (under this process's versions)."""
    env = {"device": device_name, **tables.versions(plan.device)}
    return sum(len([it for it in plan.items[phase] if it["key"] not in
                    load_rows(store_dir(device_name, plan.world, phase), phase, env)])
               for phase in PHASES if plan.items.get(phase))


def _engine_todo(plan: Plan, device_name: str, designs: dict, force: bool) -> list[dict]:
    if not designs:
        return []  # nothing measured for the flag to run on
    env = {"device": device_name, **tables.versions(plan.device)}
    stored = load_rows(store_dir(device_name, plan.world, "engine"), "engine", env)
    return engine_check.todo(plan, stored, engine_check.fingerprint(device_name, designs), force)


def _engine(plan: Plan, device_name: str, designs: dict, todo: list, deadline: float, timeout: float,
            summary: dict) -> str | None:
    """The engine phase's ranks on each design's table of per-op rows (no verdict: the flag's steps as
    those rows make them); its rows into the store. Returns why it stopped, if it did."""
    t0 = time.monotonic()
    base = tables.cache_dir() / "engine-check" / f"{tables.device_key(device_name)}-tp{plan.world}-{os.getpid()}"
    paths = {}
    for d, table in designs.items():
        paths[d] = str(base) + f"-{d}.json"
        tables.write("dispatch", device_name, plan.world, table, path=paths[d])
    print(f"tp-overlap tune: the engine's verdict: {len(todo)} step sizes, stock against the flag with "
          f"{' and '.join(designs)} fused ops and replicated", file=sys.stderr, flush=True)
    try:
        got, interrupted = _ranks(engine_check.engine_rank, plan,
                                  (plan, todo, paths, engine_check.fingerprint(device_name, designs), deadline,
                                   str(tables.cache_dir())), timeout, None)
    finally:
        for leftover in base.parent.glob(base.name + "*"):
            leftover.unlink()
    rows, stopped, env = got if got is not None else ({}, None, None)
    if rows:
        save_rows(store_dir(device_name, plan.world, "engine"), "engine", env, rows)
    summary["phases"]["engine"] = {"items": len(plan.items["engine"]), "resumed": len(plan.items["engine"]) - len(todo),
                                   "measured": len(rows), "stopped": stopped, "wall_s": time.monotonic() - t0}
    if rows:  # the time both engines took to build (weights, kernel warm-up, graphs), of the phase's
        summary["phases"]["engine"]["build_s"] = next(iter(rows.values()))["build_s"]
    return interrupted


def _finish(plan: Plan, device_name: str, summary: dict, interrupted: str | None, t0: float) -> int:
    world, model = plan.world, plan.model
    summary["wall_s"] = time.monotonic() - t0
    paths = build_tables(device_name, world, plan, summary)
    for name, p in paths.items():
        print(f"  {name}: {p}", file=sys.stderr)
    left = 0
    for phase, s in summary["phases"].items():
        s_left = s["items"] - s["resumed"] - s["measured"] - s.get("failed", 0)
        left += s_left
        note = f"; stopped: {s['stopped']}, {s_left} left" if s["stopped"] else ""
        failed_note = f", {s['failed']} failed" if s.get("failed") else ""
        print(f"  {phase}: {s['measured']} measured{failed_note}, {s['resumed']} kept from before, of {s['items']}, in "
              f"{s['wall_s']:.0f} s{note}", file=sys.stderr)
    took = time.monotonic() - t0
    if interrupted:
        error = "" if interrupted.startswith("interrupted") else "error: "
        print(f"tp-overlap tune: {error}{interrupted} after {took:.0f} s; the rows measured so far are kept in the "
              f"cache, and `{plan.command}` resumes from there.", file=sys.stderr)
        return 130 if interrupted.startswith("interrupted") else 1
    failed = tables.read("dispatch", path=paths["dispatch"]).get("failed", []) if "dispatch" in paths else []
    if failed:
        print(f"tp-overlap tune: {len(failed)} rows failed and run stock (the evidence lists why; the next run "
              f"measures them again):", file=sys.stderr)
        for f in failed:
            print(f"  {f['phase']} {f['key']}: {f['why']}", file=sys.stderr)
    stopped = any(s["stopped"] for s in summary["phases"].values())
    if plan.shapes == "model":
        uses = f"`tp-overlap serve --tp {world} --model {model} --tp-overlap` now uses these tables"
    elif {"gemm", "decode"} & set(paths):
        uses = ("Engines on this device now take these config tables from the cache; to ship them, copy them into the "
                "package's gemm_tables/ and decode_tables/")
    else:
        uses = "Nothing was measured, so no table was written"
    print(f"tp-overlap tune: done in {took:.0f} s" + (f" (stopped early with {left} rows left: run it again to measure "
                                                     f"them)" if stopped else "") + f". {uses}.", file=sys.stderr)
    return 0


def _device_name(device: str) -> str:
    """This machine's device name, asked in a child process: the ranks measure without a CUDA context
    of this process's on GPU 0 beside them."""
    if device == "cpu":
        return "cpu"
    import subprocess
    code = "import torch; print(torch.cuda.get_device_name(0))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _preflight(plan: Plan, summary: dict) -> dict:
    """Each candidate config once, in child processes (one that takes its CUDA context down is left out
    of the sweep, not the run down with it); run before the ranks start, on GPUs."""
    if plan.device != "cuda" or not plan.items.get("gemm_configs"):
        return {}
    from tp_overlap_plugin.tuning import gemm_configs as gc
    large, small = plan_candidates(plan)
    log: list[str] = []
    t0 = time.monotonic()
    crashed = gc.preflight_all(large + small, log, workers=4)
    summary["preflight_s"] = time.monotonic() - t0
    print(f"tp-overlap tune: compiled and checked {len(large + small)} GEMM configs in {summary['preflight_s']:.0f} s"
          + (f"; left out: {sorted(crashed)}" if crashed else ""), file=sys.stderr, flush=True)
    return crashed
