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

import datetime
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tp_overlap_plugin import tables
from tp_overlap_plugin.tuning.shapes import LAYER_OPS, ModelDims

PHASES = ("gemm_configs", "gemv", "all_reduce", "fused_ops", "gemm_ar")
GPU_REPEATS = 3
# seconds per measured item, for the estimate printed first. GPU: gemm_configs and gemv from the H100
# runs of 2026-11-24 (TP=1, Llama-3-8B: 28 + 20 rows in 150 s, 18 s of it the preflight); the
# collective phases are guesses from bench/overlap.py, foundation.py and gemm_ar.py runs on H200x2
# (not yet timed as tune runs). CPU: the interpreter at the CPU plan's tiny sizes.
SECONDS_PER_ITEM = {
    "cuda": {"gemm_configs": 1.5, "gemv": 3.3, "all_reduce": 2.0, "fused_ops": 2.5, "gemm_ar": 3.0},
    "cpu": {"gemm_configs": 0.5, "gemv": 0.3, "all_reduce": 1.0, "fused_ops": 2.0, "gemm_ar": 4.0},
}
START_SECONDS = {"cuda": 40.0, "cpu": 8.0}  # rank start-up, and on GPUs the configs' preflight compile


@dataclass(frozen=True)
class Plan:
    """What one run measures: per phase its items (each a dict with the row's key)."""
    model: str
    dims: ModelDims
    world: int
    device: str
    quick: bool
    repeats: int
    margin: float
    items: dict = field(default_factory=dict)

    def estimate_s(self, todo: dict | None = None) -> float:
        per = SECONDS_PER_ITEM[self.device]
        items = todo if todo is not None else self.items
        # the single-GPU phases are shared out over the ranks
        return START_SECONDS[self.device] + sum(
            per[p] * len(items.get(p, ())) / (self.world if p in ("gemm_configs", "gemv") else 1) for p in PHASES)


def make_plan(model: str, dims: ModelDims, world: int, device: str, quick: bool, margin: float) -> Plan:
    from tp_overlap_plugin.tuning import gemm_ar, gemm_configs, gemv
    dims.check_tp(world)
    gpu = device == "cuda"
    layers = dims.layers(world)
    shapes = sorted({(k, n) for _, k, n in layers})
    if gpu:
        passes = (8192, 1024, 64, 1) if quick else gemm_configs.M_PASSES
        rows = gemv.decode_rows(quick)
        sizes = [8 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20] if quick else \
            [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20, 8 << 20, 32 << 20]
        tokens = [1, 8, 32] if quick else [1, 8, 32, 128, 256]
        # decode-sized steps (multiples of W: each rank a whole number of rows) up to the prefill sizes
        fused_ms = sorted({world * m for m in ((2, 64, 512) if quick else (1, 16, 64, 256))} | {1024, 4096, 16384})
        ar_rows = [1, 16, 64] if quick else list(gemm_ar.ROWS)
    else:  # the interpreter: the pipeline, at sizes it runs in seconds
        passes, rows, sizes, tokens, fused_ms, ar_rows = (16,), [1], [8 << 10], [1], [2 * world], [1]
    items = {
        "gemm_configs": [{"key": f"{m}x{k}x{n}", "M": m, "K": k, "N": n,
                          "names": [f"{model} tp{world} {layer}" for layer, kk, nn in layers if (kk, nn) == (k, n)]}
                         for m in passes for k, n in shapes],
        "gemv": [{"key": f"{m}x{k}x{n}", "shape": f"{model} {layer}", "M": m, "K": k, "N": n}
                 for layer, k, n in layers + [dims.lm_head(world)] for m in rows],
    }
    if world > 1:
        items["all_reduce"] = ([{"key": f"ar/{b}", "bytes": b} for b in sizes]
                               + [{"key": f"norm/{dims.hidden}x{t}", "hidden": dims.hidden, "tokens": t} for t in tokens])
        items["fused_ops"] = [{"key": f"{LAYER_OPS[layer]}/{m}x{k}x{n}", "layer": layer, "op": LAYER_OPS[layer],
                               "M": m, "K": k, "N": n} for layer, k, n in layers for m in fused_ms]
        # the interpreter: one row layer shows the pipeline (and eagerly the rule says stock anyway)
        row_layers = [x for x in layers if LAYER_OPS[x[0]] == "rs"][:None if gpu else 1]
        items["gemm_ar"] = [{"key": f"{m}x{k}x{n}", "shape": f"{model} {layer}", "M": m, "K": k, "N": n}
                            for layer, k, n in row_layers for m in ar_rows]
    return Plan(model, dims, world, device, quick, GPU_REPEATS if gpu else 1, margin, items)


# ---- the measurement store --------------------------------------------------------------------

def store_dir(device_name: str, world: int, phase: str | None = None) -> Path:
    """Where a phase's rows are kept: per device and TP size, except the GEMM configs' (one GPU's
    measurements, for the one config table per device that every TP size's shapes go into)."""
    if phase == "gemm_configs":
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
    with tables.locked(path):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        if not isinstance(old, dict) or not _same_versions(old.get("environment", {}), env):
            old = {}
        data = {**old, **(extra or {}), "environment": env, "rows": {**old.get("rows", {}), **rows}}
        tables.write_atomic(path, json.dumps(data, indent=1))


# ---- the ranks --------------------------------------------------------------------------------

def _env(ctx, plan: Plan) -> dict:
    from tp_overlap_plugin.tuning.results import environment
    env = environment(plan.world, on_gpu=plan.device == "cuda", model=plan.model)
    env.update(tables.versions(plan.device))
    return env


class _Lines:
    """The progress bar where tqdm is not installed: a line per tenth of the phase, with its ETA."""

    def __init__(self, phase: str, total: int, done: int):
        self.phase, self.total, self.n, self.start_n = phase, total, done, done
        self.t0, self.shown = time.monotonic(), -1

    def update(self, k: int) -> None:
        self.n += k
        tenth = 10 * self.n // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            rate = (time.monotonic() - self.t0) / max(self.n - self.start_n, 1)
            print(f"{self.phase:>12s}: {self.n}/{self.total} rows, {time.monotonic() - self.t0:.0f} s, "
                  f"ETA {rate * (self.total - self.n):.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _bar(ctx, phase: str, total: int, done: int):
    if ctx.rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(phase, total, done)
    # A thread lock: tqdm's default one adds a multiprocessing semaphore, which this rank's os._exit leaks
    # (the resource tracker then warns as tune ends).
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=done, desc=f"{phase:>12s}", unit="row", file=sys.stderr, dynamic_ncols=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")


def _agree(ctx, value):
    """Rank 0's value on every rank (todo lists and the budget's go/stop must be alike everywhere)."""
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def tune_rank(ctx, plan: Plan, deadline: float, force: bool, crashed: dict, cache: str):
    """One rank of a tune run. Rank 0 keeps the store; returns rank 0's summary per phase."""
    import torch
    import torch.distributed as dist
    os.environ["TP_OVERLAP_CACHE"] = cache  # the parent's cache, whatever this process inherited
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    env = _agree(ctx, _env(ctx, plan) if ctx.rank == 0 else None)
    summary = {"environment": env, "phases": {}}
    for phase in PHASES:
        items = plan.items.get(phase)
        if not items:
            continue
        directory = store_dir(env["device"], plan.world, phase)
        have = _agree(ctx, set() if force or ctx.rank else set(load_rows(directory, phase, env)))
        todo = [it for it in items if it["key"] not in have]
        bar = _bar(ctx, phase, len(items), len(items) - len(todo))
        state = {"measured": 0, "stopped": None}

        def keep(rows: dict, extra=None, _phase=phase, _state=state, _bar=bar, _dir=directory):
            if ctx.rank == 0 and rows:
                save_rows(_dir, _phase, env, rows, extra)
            _state["measured"] += len(rows)
            if _bar is not None:
                _bar.update(len(rows))

        def go() -> bool:
            ok = _agree(ctx, time.time() < deadline if ctx.rank == 0 else None)
            if not ok:
                state["stopped"] = "the time budget ran out"
            return ok
        try:
            PHASE_RUNNERS[phase](ctx, plan, todo, keep, go, crashed)
        finally:
            if bar is not None:
                bar.close()
        summary["phases"][phase] = {"items": len(items), "resumed": len(items) - len(todo),
                                    "measured": state["measured"], "stopped": state["stopped"]}
        dist.barrier(group=ctx.group)
    if ctx.heap is not None:
        ctx.heap.check()
    return summary


def _shared_out(ctx, todo: list, measure, keep, go) -> None:
    """A single-GPU phase: rank r measures items r, r + W, ...; after each round rank 0 keeps them all."""
    import torch.distributed as dist
    W = ctx.world_size
    for start in range(0, len(todo), W):
        if not go():
            return
        mine = todo[start + ctx.rank] if start + ctx.rank < len(todo) else None
        got = measure(mine) if mine is not None else {}
        parts = [None] * W
        dist.all_gather_object(parts, got, group=ctx.group)
        keep({k: v for part in parts for k, v in part.items()})


def _gemm_configs(ctx, plan, todo, keep, go, crashed):
    import torch

    from tp_overlap_plugin.tuning import gemm_configs as gc
    large, small = plan_candidates(plan)
    large = [c for c in large if c.label() not in crashed]
    small = [c for c in small if c.label() not in crashed]
    timer = gc.Timer(ctx.device)
    failed: dict = {}
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    l2 = gc.l2_bytes(ctx.device)

    def measure(it):
        cands = (large if it["M"] >= gc.LARGE_FROM else []) + (small if it["M"] <= gc.SMALL_UPTO else [])
        entry = gc.measure_entry(it["M"], it["K"], it["N"], it["names"], cands, timer, failed, gen, l2,
                                 dry_run=plan.device == "cpu")
        if "stopped" in entry:  # the CUDA context is gone: end the run, keeping the rows measured before
            raise RuntimeError(f"GEMM config sweep stopped: {entry['stopped']}")
        return {it["key"]: entry}
    extra = {"candidates": {"large": [c.to_dict() for c in large], "small": [c.to_dict() for c in small]},
             "crashed": crashed}
    _shared_out(ctx, todo, measure, lambda rows: keep(rows, extra), go)


def plan_candidates(plan: Plan):
    """The configs to try: all of gemm_configs.candidates() on a GPU; on the CPU (interpreter) one of
    each kind, as the pipeline's check."""
    from tp_overlap_plugin.tuning import gemm_configs as gc
    large, small = gc.candidates()
    if plan.device == "cpu":
        return large[:1], [small[0], small[2]]
    return large, small


def _gemv(ctx, plan, todo, keep, go, crashed):
    from tp_overlap_plugin.tuning import gemv
    gpu = plan.device == "cuda"

    def measure(it):
        (row,) = gemv.measure([(it["shape"], it["K"], it["N"])], [it["M"]], gpu, repeats=plan.repeats)
        return {it["key"]: row}
    _shared_out(ctx, todo, measure, keep, go)


def _all_reduce(ctx, plan, todo, keep, go, crashed):
    from tp_overlap_plugin.collectives import HeapAllReduce
    from tp_overlap_plugin.tuning import allreduce
    sizes = [it for it in todo if "bytes" in it]
    norms = [it for it in todo if "tokens" in it]
    samples = 15 if plan.device == "cuda" else 1
    with ctx.heap.scope():
        if sizes:
            top = max(it["bytes"] for it in plan.items["all_reduce"] if "bytes" in it)
            # one-shot measured up to the heap's capacity for it: "auto" (what the table compares) takes
            # it up to DEFAULT_ONE_SHOT_BYTES only
            comm = HeapAllReduce(ctx.heap, max_bytes=top, one_shot_max_bytes=min(top, 8 << 20))
            symm = allreduce.torch_symm_all_reduce(ctx, top)
            for it in sizes:
                if not go():
                    return
                (row,) = allreduce.all_reduce_sweep(ctx, comm, symm, [it["bytes"]], repeats=plan.repeats,
                                                    samples=samples)
                keep({it["key"]: row})
            _quiesce(ctx)
    if norms:
        symm = allreduce.torch_symm_all_reduce(ctx, max(it["tokens"] for it in norms) * plan.dims.hidden * 2)
        for it in norms:
            if not go():
                return
            with ctx.heap.scope():  # each size's buffers, then the space back (heap_bytes holds one)
                (row,) = allreduce.norm_sweep(ctx, symm, it["hidden"], [it["tokens"]], repeats=plan.repeats,
                                              samples=samples)
                _quiesce(ctx)
            keep({it["key"]: row})


def _quiesce(ctx) -> None:
    """Every rank done with the heap space of a scope before any reuses it (peers write into it)."""
    import torch
    import torch.distributed as dist
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    ctx.heap.check()
    dist.barrier(group=ctx.group)


def _fused_ops(ctx, plan, todo, keep, go, crashed):
    from tp_overlap_plugin.tuning import fused_ops
    gpu = plan.device == "cuda"
    for it in todo:
        if not go():
            return
        row: dict = {}
        calls = (10 if it["M"] <= 1024 else 5) if gpu else 1
        fused_ops.measure_shape(ctx, it["op"], it["M"], it["K"], it["N"], None, row, calls,
                                variants=fused_ops.TABLE + (("ours_graph", "sequential_graph") if gpu else ()),
                                repeats=plan.repeats, samples=7 if gpu else 1, log=False)
        keep({it["key"]: row})


def _gemm_ar(ctx, plan, todo, keep, go, crashed):
    from tp_overlap_plugin.tuning import gemm_ar
    for it in todo:
        if not go():
            return
        with ctx.heap.scope():  # each row's buffers, then the space back (heap_bytes holds the largest)
            (row,) = gemm_ar.measure(ctx, [(it["shape"], it["K"], it["N"])], [it["M"]], repeats=plan.repeats,
                                     samples=10 if plan.device == "cuda" else 1)
            _quiesce(ctx)
        keep({it["key"]: row})


PHASE_RUNNERS = {"gemm_configs": _gemm_configs, "gemv": _gemv, "all_reduce": _all_reduce, "fused_ops": _fused_ops,
                 "gemm_ar": _gemm_ar}


def heap_bytes(plan: Plan) -> int:
    from tp_overlap_plugin.collectives import HeapAllReduce
    from tp_overlap_plugin.tuning import allreduce, gemm_ar
    if plan.world == 1:
        return 1 << 20
    W = plan.world
    ar = plan.items["all_reduce"]
    top = max(it["bytes"] for it in ar if "bytes" in it)
    tokens = max(it["tokens"] for it in ar if "tokens" in it)
    size = max(HeapAllReduce.heap_bytes(W, top, min(top, 8 << 20)), allreduce.norm_heap_bytes(W, plan.dims.hidden, tokens))
    fused = 0
    for it in plan.items["fused_ops"]:  # one op's buffers at a time (a heap scope per shape)
        rows, elsize = -(-it["M"] // W), 2
        # AG-GEMM: [W - 1, rows, K] receive slots; GEMM-RS: two halves of [W - 1, rows, N]; + flags
        need = (max(W - 1, 1) * rows * it["K"] * elsize if it["op"] == "ag"
                else 2 * max(W - 1, 1) * rows * it["N"] * elsize) + (1 << 20)
        fused = max(fused, need)
    shapes = [(it["shape"], it["K"], it["N"]) for it in plan.items["gemm_ar"]]
    size = max(size, fused, gemm_ar.heap_bytes(W, shapes, [it["M"] for it in plan.items["gemm_ar"]]))
    return -(-(size + (16 << 20)) // 4096) * 4096


# ---- tables and evidence ------------------------------------------------------------------------

def build_tables(device_name: str, world: int, plan: Plan) -> dict:
    """The dispatch table and (for the GEMM core) the config table from everything in the store
    (every model tuned here at this TP size), written atomically into the cache under the lock; the
    evidence markdown and PNG beside them. Returns the paths."""
    from tp_overlap_plugin.tuning import gemm_configs as gc
    from tp_overlap_plugin.tuning import rules
    stored = {}
    for phase in PHASES:
        path = store_dir(device_name, world, phase) / f"{phase}.json"
        if path.exists():
            try:
                stored[phase] = json.loads(path.read_text())
            except ValueError as e:
                print(f"tp-overlap tune: skipping {path}: {e}", file=sys.stderr)
    if not stored:
        return {}
    env = next(iter(stored.values()))["environment"]
    env = {**env, "date": datetime.date.today().isoformat()}
    out = {}
    models = sorted({r.get("shape", "").split(" ")[0] for p in ("gemv", "gemm_ar") if p in stored
                     for r in stored[p]["rows"].values()} - {""})
    command = tables.tune_command(world, plan.model)

    def rows(phase):
        return list(stored[phase]["rows"].values()) if phase in stored else []
    ar = rows("all_reduce")
    overlap = {"environment": env, "sweep": {r_key: r for r_key, r in stored["fused_ops"]["rows"].items()}} \
        if "fused_ops" in stored else None
    foundation = {"rank0": {"all_reduce": sorted([r for r in ar if "tokens" not in r], key=lambda r: r["bytes"])}} \
        if "all_reduce" in stored else None
    table = rules.build(overlap, foundation, {"environment": env, "rows": rows("gemm_ar")} if "gemm_ar" in stored else None,
                        {"environment": env, "rows": rows("gemv")} if "gemv" in stored else None, env=env, margin=plan.margin,
                        command=command, extra={"models": models, "tuned_by": "tp-overlap tune"})
    path = tables.cached_path("dispatch", device_name, world)
    with tables.locked(path):
        tables.write_atomic(path, json.dumps(table, indent=1))
    out["dispatch"] = path
    md = rules.markdown(table, [(LAYER_OPS[layer], k, n) for layer, k, n in plan.dims.layers(world)], plan.model)
    norm_rows = [r for r in ar if "tokens" in r]
    if norm_rows:
        md += _norm_markdown(norm_rows)
    if "gemm_configs" in stored:
        g = stored["gemm_configs"]
        payload = {"environment": {**g["environment"], "tp": world}, "candidates": g.get("candidates", {"large": [], "small": []}),
                   "results": sorted(g["rows"].values(), key=lambda e: (-e["M"], e["K"], e["N"])),
                   "stopped": None, "crashed": g.get("crashed", {})}
        gtable, gmd = gc.build_table(payload)
        gtable["source"] = "tp-overlap tune"
        gpath = tables.cached_path("gemm", device_name)
        with tables.locked(gpath):
            tables.write_atomic(gpath, gc.dump_table(gtable))
        # the results file `bench/gemm_configs.py table` rebuilds the table and its markdown from
        tables.write_atomic(store_dir(device_name, world, "gemm_configs") / "gemm-configs-results.json",
                            json.dumps(payload, indent=1))
        out["gemm"] = gpath
        md += "\n# GEMM core configs\n\n" + gmd
    stem = tables.cache_dir() / "evidence" / f"{tables.device_key(device_name)}-tp{world}"
    tables.write_atomic(stem.with_suffix(".md"), _header(table, plan) + md)
    out["evidence"] = stem.with_suffix(".md")
    png = _chart(table, stem.with_suffix(".png"))
    out["png"] = png or "no PNG: matplotlib is not installed (pip install matplotlib)"
    return out


def _header(table: dict, plan: Plan) -> str:
    return (f"# tp-overlap tune: {table['device']}, TP={table['world']}\n\n"
            f"Measured {table['date']} under torch {table['torch']}, Triton {table['triton']}, driver "
            f"{table.get('driver')}; models {', '.join(table.get('models', [])) or plan.model}. Each row was timed "
            f"in {plan.repeats} interleaved repeat(s); ours is chosen only where it won by {table['margin']}x in every "
            f"repeat. Ratios are stock/ours, median [min–max] over the repeats.\n\nRegenerate: `{table['command']}`.\n\n")


def _norm_markdown(rows: list[dict]) -> str:
    from tp_overlap_plugin.tuning.results import md_table
    mode = "graph" if any("fused_graph_us" in r for r in rows) else "eager"
    out = (f"\n## Fused all-reduce + add + RMSNorm ({mode}, µs)\n\nAgainst an all-reduce followed by the add + norm "
           "kernel; the engine takes the fused kernel where our all-reduce is chosen.\n\n")
    return out + md_table(["hidden", "T", "fused", "ours then norm", "NCCL then norm", "NCCL+norm / fused"],
                          [[r["hidden"], r["tokens"], r.get(f"fused_{mode}_us"), r.get(f"ours_then_norm_{mode}_us"),
                            r.get(f"nccl_then_norm_{mode}_us"),
                            r.get(f"nccl_then_norm_{mode}_us", float("nan")) / r.get(f"fused_{mode}_us", float("nan"))]
                           for r in sorted(rows, key=lambda r: (r["hidden"], r["tokens"]))])


def _chart(table: dict, path: Path) -> str | None:
    """Every row's ratio stock/ours with its spread over the repeats, per section; None without
    matplotlib."""
    from tp_overlap_plugin.tuning.results import pyplot
    plt = pyplot()
    if plt is None:
        return None
    sections = [("GEMV vs F.linear", [(f"{r['shape']} M={r['M']}", r.get("ratio"), r["winner"] != "stock",
                                       r["cublas_us"] / r["gemv_us"]) for r in table.get("gemv", [])]),
                ("AG/RS vs sequential", [(f"{r['op']} M={r['M']} {r['K']}x{r['N']}", r.get("ratio"),
                                          r["winner"] != "stock", r["speedup"]) for r in table["gemm"]]),
                ("all-reduce vs NCCL (graph)", [(f"{r['bytes'] >> 10} KB", r.get("graph_ratio"),
                                                 r["graph_winner"] != "stock",
                                                 (r["nccl_graph_us"] or 0) / (r["ours_graph_us"] or 1))
                                                for r in table["all_reduce"]]),
                ("GEMM+AR vs best stock (graph)", [(f"{r['shape']} M={r['M']}", r.get("graph_ratio"),
                                                    r["graph_winner"] != "stock",
                                                    (r["graph_best_stock_us"] or 0) / (r["graph_us"] or 1))
                                                   for r in table.get("gemm_all_reduce", [])])]
    sections = [(t, rows) for t, rows in sections if rows]
    if not sections:
        return None
    fig, axes = plt.subplots(len(sections), 1, figsize=(max(8, 0.3 * max(len(r) for _, r in sections)),
                                                        3.2 * len(sections)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], sections):
        xs = range(len(rows))
        med = [r[1][1] if r[1] else r[3] for r in rows]
        err = [[m - (r[1][0] if r[1] else m) for m, r in zip(med, rows)],
               [(r[1][2] if r[1] else m) - m for m, r in zip(med, rows)]]
        ax.bar(xs, [m - 1 for m in med], bottom=1, color=["tab:green" if r[2] else "tab:gray" for r in rows], alpha=0.6)
        ax.errorbar(xs, med, yerr=err, fmt="o", color="black", capsize=3, markersize=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(table["margin"], color="tab:green", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), [r[0] for r in rows], rotation=60, ha="right", fontsize=6)
        ax.set_title(f"{title}: stock/ours, median and min-max over repeats (green: ours chosen)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---- the command --------------------------------------------------------------------------------

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
        error = "" if interrupted.startswith("interrupted") else "error: "
        print(f"tp-overlap tune: {error}{interrupted} after {took:.0f} s; the rows measured so far are kept in the "
              f"cache, and `tp-overlap tune --tp {world} --model {model}` resumes from there.", file=sys.stderr)
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
