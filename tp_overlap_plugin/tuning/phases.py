"""The phases of `tp-overlap tune` as its W ranks run them: rank 0 keeps the store, every rank agrees
on the to-do list and on when the time budget stops the run, and each phase measures its items (the
single-GPU phases shared out over the ranks, the collective ones together)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from tp_overlap_plugin.tuning import report
from tp_overlap_plugin.tuning.plan import PHASES, Plan, plan_candidates
from tp_overlap_plugin.multirank import agree
from tp_overlap_plugin.tuning.store import environment, load_rows, save_rows, store_dir


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


def tune_rank(ctx, plan: Plan, deadline: float, force: bool, crashed: dict, cache: str, failed_before: dict):
    """One rank of a tune run. Rank 0 keeps the store; returns rank 0's summary per phase.
    `failed_before`: {"<phase>/<key>": why} rows a rank of an earlier start died measuring (tune.run
    restarts the ranks): recorded as failed, not measured again in this run."""
    import torch
    import torch.distributed as dist
    os.environ["TP_OVERLAP_CACHE"] = cache  # the parent's cache, whatever this process inherited
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    env = agree(ctx, environment(plan) if ctx.rank == 0 else None)
    summary = {"environment": env, "phases": {}}
    for phase in PHASES:
        items = plan.items.get(phase)
        if not items:
            continue
        t0 = time.monotonic()
        directory = store_dir(env["device"], plan.world, phase)
        have = agree(ctx, set() if force or ctx.rank else _kept(ctx, directory, phase, env))
        todo = [it for it in items if it["key"] not in have]
        bar = _bar(ctx, phase, len(items), len(items) - len(todo))
        state = {"measured": 0, "stopped": None, "failed": 0}
        died = {it["key"]: failed_row(it, failed_before[f"{phase}/{it['key']}"]) for it in todo
                if f"{phase}/{it['key']}" in failed_before}
        todo = [it for it in todo if it["key"] not in died]

        def keep(rows: dict, extra=None, _phase=phase, _state=state, _bar=bar, _dir=directory):
            if ctx.rank == 0 and rows:
                save_rows(_dir, _phase, env, rows, extra)
            _state["measured"] += len(rows)
            if _bar is not None:
                _bar.update(len(rows))

        def go() -> bool:
            ok = agree(ctx, time.time() < deadline if ctx.rank == 0 else None)
            if not ok:
                state["stopped"] = "the time budget ran out"
            return ok
        attempt = _attempt(ctx, phase, cache, state)
        if died:
            keep(died)
            state["failed"] += len(died)
        try:
            PHASE_RUNNERS[phase](ctx, plan, todo, keep, go, crashed, attempt)
        finally:
            if bar is not None:
                bar.close()
        if phase in TABLES_AFTER:
            _write_table(ctx, phase, env, plan)
        summary["phases"][phase] = {"items": len(items), "resumed": len(items) - len(todo) - len(died),
                                    "measured": state["measured"] - state["failed"], "failed": state["failed"],
                                    "stopped": state["stopped"], "wall_s": time.monotonic() - t0}
        dist.barrier(group=ctx.group)
    if ctx.heap is not None:
        ctx.heap.check()
    return summary


def failed_row(it: dict, why: str) -> dict:
    """A row that failed (its check, or a rank died measuring it): what it was, and why; no times, so
    the rules leave it out of the table (it runs stock), and the evidence lists it."""
    return {**{k: v for k, v in it.items() if k != "key"}, "row_failed": why}


def _attempt(ctx, phase: str, cache: str, state: dict):
    """attempt(item, measure) -> {key: row}: `measure()` run with this rank's in-progress mark set (tune.run
    reads the marks of a rank that died, and starts the ranks again without those rows); a failed check
    (checks.CheckFailed, agreed by every rank of a collective phase) gives the row as failed, and tune
    goes on. TP_OVERLAP_TUNE_FAIL (a test hook, options.env_tune_fail): {"<phase>/<key>": "check" |
    "crash"} fails that row's check on every rank, or kills the last rank while it measures the row."""
    from tp_overlap_plugin import options
    from tp_overlap_plugin.tuning.checks import CheckFailed
    forced = options.env_tune_fail()

    def attempt(it: dict, measure) -> dict:
        name = f"{phase}/{it['key']}"
        mark_in_progress(cache, ctx.rank, name)
        try:
            if forced.get(name) == "check":
                raise CheckFailed("failed on purpose (TP_OVERLAP_TUNE_FAIL)")
            if forced.get(name) == "crash" and ctx.rank == ctx.world_size - 1:
                os._exit(3)
            rows = measure()
        except CheckFailed as e:
            rows = {it["key"]: failed_row(it, str(e))}
            state["failed"] += 1
            if ctx.rank == 0:
                print(f"tp-overlap tune: {name} failed its check and runs stock: {e}", file=sys.stderr, flush=True)
        mark_in_progress(cache, ctx.rank, None)
        return rows
    return attempt


MARKS = "tune-in-progress"  # in the cache: a file per rank naming the row it is measuring


def mark_in_progress(cache: str, rank: int, name: str | None) -> None:
    """This rank's in-progress mark (`marked` reads it): the row it is measuring, or none."""
    path = Path(cache) / MARKS / f"rank{rank}"
    if name is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(name)


def marked(cache) -> dict:
    """{"<phase>/<key>": rank} of the rows ranks were measuring when the run stopped."""
    marks = Path(cache) / MARKS
    return {p.read_text(): int(p.name[4:]) for p in marks.glob("rank*")} if marks.is_dir() else {}


def clear_marks(cache) -> None:
    for p in (Path(cache) / MARKS).glob("rank*"):
        p.unlink(missing_ok=True)


def _kept(ctx, directory, phase: str, env: dict) -> set:
    """The keys of the phase's stored rows that need no measuring again: measured under these versions,
    and a GEMV row only if it timed the config the decode table picks now."""
    rows = {key: r for key, r in load_rows(directory, phase, env).items() if "row_failed" not in r}  # (tried again)
    if phase == "gemv":
        from tp_overlap_plugin.decode_config import pick_decode_config
        return {key for key, r in rows.items()
                if r.get("config") == pick_decode_config(r["M"], r["N"], r["K"], ctx.device).label()}
    return set(rows)


def _write_table(ctx, phase: str, env: dict, plan: Plan) -> None:
    """After a config phase, its table from the store into the cache (rank 0), and every rank's
    lookups read it from then on: the later phases measure on the configs that will be served."""
    import torch.distributed as dist

    from tp_overlap_plugin import decode_config, gemm_config
    if ctx.rank == 0:
        TABLES_AFTER[phase](env["device"], plan.world, plan)
    dist.barrier(group=ctx.group)
    gemm_config.find_table.cache_clear()
    decode_config.load_table.cache_clear()


def _shared_out(ctx, todo: list, measure, keep, go, attempt) -> None:
    """A single-GPU phase: rank r measures items r, r + W, ...; after each round rank 0 keeps them all."""
    import torch.distributed as dist
    W = ctx.world_size
    for start in range(0, len(todo), W):
        if not go():
            return
        mine = todo[start + ctx.rank] if start + ctx.rank < len(todo) else None
        got = attempt(mine, lambda: measure(mine)) if mine is not None else {}
        parts = [None] * W
        dist.all_gather_object(parts, got, group=ctx.group)
        keep({k: v for part in parts for k, v in part.items()})


def _gemm_configs(ctx, plan, todo, keep, go, crashed, attempt):
    import torch

    from tp_overlap_plugin.tuning import gemm_configs as gc
    from tp_overlap_plugin.tuning.timing import capture_stream
    large, small = plan_candidates(plan)
    large = [c for c in large if c.label() not in crashed]
    small = [c for c in small if c.label() not in crashed]
    stream = capture_stream(ctx.device)
    failed: dict = {}
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    l2 = gc.l2_bytes(ctx.device)

    def measure(it):
        cands = (large if it["M"] >= gc.LARGE_FROM else []) + (small if it["M"] <= gc.SMALL_UPTO else [])
        entry = gc.measure_entry(it["M"], it["K"], it["N"], it["names"], cands, ctx.device, stream, failed, gen, l2,
                                 dry_run=plan.device == "cpu")
        if "stopped" in entry:  # the CUDA context is gone: end the run, keeping the rows measured before
            raise RuntimeError(f"GEMM config sweep stopped: {entry['stopped']}")
        return {it["key"]: entry}
    extra = {"candidates": {"large": [c.to_dict() for c in large], "small": [c.to_dict() for c in small]},
             "crashed": crashed}
    _shared_out(ctx, todo, measure, lambda rows: keep(rows, extra), go, attempt)


def _decode_configs(ctx, plan, todo, keep, go, crashed, attempt):
    import torch

    from tp_overlap_plugin.tuning import decode_configs as dc
    from tp_overlap_plugin.tuning.timing import capture_stream
    cands = dc.candidates(plan.device)
    stream = capture_stream(ctx.device)
    failed: dict = {}
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)

    def measure(it):
        return {it["key"]: dc.measure_entry(it["M"], it["K"], it["N"], it["names"], cands, ctx.device, stream,
                                            failed, gen)}
    extra = {"candidates": {c.label(): c.to_dict() for c in cands}}
    _shared_out(ctx, todo, measure, lambda rows: keep(rows, extra), go, attempt)


def _silu_mul(ctx, plan, todo, keep, go, crashed, attempt):
    import torch

    from tp_overlap_plugin.tuning import silu_mul
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)

    def measure(it):
        return {it["key"]: silu_mul.measure_row(it["shape"], it["M"], it["K"], it["N"], ctx.device,
                                                repeats=plan.repeats, gen=gen)}
    _shared_out(ctx, todo, measure, keep, go, attempt)


def _gemv(ctx, plan, todo, keep, go, crashed, attempt):
    from tp_overlap_plugin.tuning import gemv
    gpu = plan.device == "cuda"

    def measure(it):
        (row,) = gemv.measure([(it["shape"], it["K"], it["N"])], [it["M"]], gpu, repeats=plan.repeats)
        return {it["key"]: row}
    _shared_out(ctx, todo, measure, keep, go, attempt)


def _all_reduce(ctx, plan, todo, keep, go, crashed, attempt):
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
    from tp_overlap_plugin.tuning import all_reduce
    sizes = [it for it in todo if "bytes" in it]
    norms = [it for it in todo if "tokens" in it]
    samples = 15 if plan.device == "cuda" else 1
    with ctx.heap.scope():
        if sizes:
            top = max(it["bytes"] for it in plan.items["all_reduce"] if "bytes" in it)
            # one-shot measured up to the heap's capacity for it: "auto" (what the table compares) takes
            # it up to DEFAULT_ONE_SHOT_BYTES only
            comm = HeapAllReduce(ctx.heap, max_bytes=top, one_shot_max_bytes=min(top, 8 << 20))
            symm = all_reduce.torch_symm_all_reduce(ctx, top)
            for it in sizes:
                if not go():
                    return
                keep(attempt(it, lambda it=it: {it["key"]: all_reduce.all_reduce_sweep(
                    ctx, comm, symm, [it["bytes"]], repeats=plan.repeats, samples=samples)[0]}))
            _quiesce(ctx)
    if norms:
        symm = all_reduce.torch_symm_all_reduce(ctx, max(it["tokens"] for it in norms) * plan.dims.hidden * 2)
        for it in norms:
            if not go():
                return
            with ctx.heap.scope():  # each size's buffers, then the space back (heap_bytes holds one)
                rows = attempt(it, lambda it=it: {it["key"]: all_reduce.norm_sweep(
                    ctx, symm, it["hidden"], [it["tokens"]], repeats=plan.repeats, samples=samples)[0]})
                _quiesce(ctx)
            keep(rows)


def _quiesce(ctx) -> None:
    """Every rank done with the heap space of a scope before any reuses it (peers write into it)."""
    import torch
    import torch.distributed as dist
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    ctx.heap.check()
    dist.barrier(group=ctx.group)


def _fused_ops(ctx, plan, todo, keep, go, crashed, attempt):
    from tp_overlap_plugin.tuning import fused_ops
    gpu = plan.device == "cuda"
    for it in todo:
        if not go():
            return
        calls = (10 if it["M"] <= 1024 else 5) if gpu else 1

        def measure(it=it, calls=calls):
            row: dict = {}
            fused_ops.measure_shape(ctx, it["op"], it["M"], it["K"], it["N"], None, row, calls,
                                    variants=fused_ops.TABLE + (("ours_graph", "sequential_graph") if gpu else ()),
                                    repeats=plan.repeats, samples=7 if gpu else 1, log=False, design=it["design"])
            return {it["key"]: row}
        keep(attempt(it, measure))


def _gemm_ar(ctx, plan, todo, keep, go, crashed, attempt):
    from tp_overlap_plugin.tuning import gemm_ar
    for it in todo:
        if not go():
            return
        with ctx.heap.scope():  # each row's buffers, then the space back (heap_bytes holds the largest)
            rows = attempt(it, lambda it=it: {it["key"]: gemm_ar.measure(
                ctx, [(it["shape"], it["K"], it["N"])], [it["M"]], repeats=plan.repeats,
                samples=10 if plan.device == "cuda" else 1)[0]})
            _quiesce(ctx)
        keep(rows)


PHASE_RUNNERS = {"gemm_configs": _gemm_configs, "decode_configs": _decode_configs, "gemv": _gemv,
                 "silu_mul": _silu_mul, "all_reduce": _all_reduce, "fused_ops": _fused_ops, "gemm_ar": _gemm_ar}


# the config phases whose table the later phases run on
TABLES_AFTER = {"gemm_configs": report.write_gemm_table, "decode_configs": report.write_decode_table}
