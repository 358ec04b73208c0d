"""The dispatcher's table from measurements: the one copy of its decision rules ("never slower than
stock"). `build` reads the rows as `tp-overlap tune`'s store holds them, per phase {key: row}
(tuning/store.py); tune calls it on its store, the one writer of the table. The shipped tables are
tune's, and integration_tests/test_bench_scripts.py builds each again from its run's store (shipped in
bench/results/tune-store-*).

A row picks ours only when ours wins by MARGIN (the run-to-run noise seen here is ~2%) in every
interleaved repeat: with repeats, each repeat's ratio stock/ours must reach the margin, and the table
keeps the ratios' median and spread ("ratio": [min, median, max]); a run of one repeat (the older
bench results) has one ratio.
"""

from __future__ import annotations

import statistics

from tp_overlap_plugin import tables
from tp_overlap_plugin.ops.all_reduce import DEFAULT_ONE_SHOT_BYTES
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.options import DESIGNS
from tp_overlap_plugin.tuning.results import md_table

MARGIN = 1.02
# The engine's verdict (tune's engine phase, tuning/engine_check.py): a step size keeps the flag only
# where the flag's whole step beat the stock engine's by this much in every interleaved repeat. Lower
# than an op's MARGIN: a step's time sums a few hundred ops and host work whose independent noise
# averages out, and each repeat already averages several steps; the closest stock-vs-flag pairs seen
# end to end spread 0.3% (issue 39: TP=2 prefill-b32 0.987-0.990 over 3 pairs, H200x4), and 1% is
# three times that. A real win smaller than 1% is given up to stay never slower than stock.
ENGINE_MARGIN = 1.01
# The engine's all-reduce runs algorithm "auto": one-shot up to the op's one-shot limit (ops.all_reduce.
# DEFAULT_ONE_SHOT_BYTES), two-shot above; so that is the time the table compares with NCCL. Each rank
# of a one-shot reads every peer's whole message, W - 1 times a ring's traffic: with v1 at 2 MB it won
# in a CUDA graph on idle links (21.8 vs 29.5 us) yet cost 7% of decode throughput at batch 256 end to
# end (bench/results/e2e-llama-3-8b-tp2-h200x2-2026-11-22-ipc2mb.md). Two-shot moves what a ring moves.


def _repeats(r: dict, key: str) -> list[float] | None:
    """A measurement's repeats (`key`_repeats) or its one value; None if it was not measured."""
    if isinstance(r.get(key + "_repeats"), list):
        return r[key + "_repeats"]
    return [r[key]] if isinstance(r.get(key), (int, float)) and r[key] else None


def ratios(stock: list[float] | None, ours: list[float] | None) -> list[float]:
    """stock/ours per interleaved repeat (higher: ours faster); [] if either side is missing."""
    if not stock or not ours:
        return []
    return [s / o for s, o in zip(stock, ours) if o]


def wins(rs: list[float], margin: float) -> bool:
    """Ours wins only if it won by the margin in every repeat."""
    return bool(rs) and min(rs) >= margin


def _spread(row: dict, key: str, rs: list[float]) -> None:
    if len(rs) > 1:
        row[key] = [min(rs), statistics.median(rs), max(rs)]


def one_shot_crossover(all_reduce: list[dict]) -> int:
    """"auto"'s one-shot limit for the measured device and world size: the largest size up to which
    the one-shot took no longer than the two-shot in CUDA graphs at every measured size, at most
    DEFAULT_ONE_SHOT_BYTES (what its receive slots hold). At W=2 on H200 the one-shot wins to 1 MB; at
    W=4 the two-shot wins from 512 KB (bench/notes/allreduce.md): a constant fits one W only. Runs
    from before the two-shot was measured keep the old constant."""
    limit = 0
    for r in sorted(all_reduce, key=lambda r: r["bytes"]):
        one, two = r.get("ours_one_shot_graph_us"), r.get("ours_two_shot_graph_us")
        if r["bytes"] > DEFAULT_ONE_SHOT_BYTES:
            break
        if two is None:
            return DEFAULT_ONE_SHOT_BYTES
        if one is None or one > two:
            break
        limit = r["bytes"]
    return limit


def auto_algorithm(r: dict, crossover: int = DEFAULT_ONE_SHOT_BYTES) -> str:
    """The kernel "auto" runs at this size; runs from before two-shot was measured have the one-shot
    only, which "auto" then was."""
    return "two_shot" if r["bytes"] > crossover and "ours_two_shot_graph_us" in r else "one_shot"


def gemm_all_reduce_rows(measured: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N): GEMM + all-reduce against the faster of what runs without it (F.linear
    + NCCL or + our all-reduce; with the norm after it, + NCCL + norm or + our fused all-reduce +
    norm), in CUDA graphs and eager. A mode that was not measured is "stock"; other columns of a
    measurement (the layer and the norm as one kernel, in stores from before that kernel was removed)
    are ignored.

    Eagerly it is always "stock": there every variant is launch-bound (47-190 us for kernels of
    7-70 us on H200x2, 2026-11-23) and the same variant scatters more between neighbouring M than
    the variants differ, so an eager "win" would be noise. Decode steps, where this op applies,
    run in CUDA graphs."""
    rows = []
    for r in measured.values():
        row = {"M": r["M"], "K": r["K"], "N": r["N"], "shape": r["shape"]}
        for mode in ("graph", "eager"):
            for prefix, ours, others in (("", "gemm_ar", ("linear_nccl", "linear_ours")),
                                         ("norm_", "gemm_ar_norm", ("linear_nccl_norm", "linear_fused_norm"))):
                t = r.get(f"{ours}_{mode}_us")
                best = min((r[f"{o}_{mode}_us"] for o in others if f"{o}_{mode}_us" in r), default=None)
                row[f"{prefix}{mode}_us"], row[f"{prefix}{mode}_best_stock_us"] = t, best
                alts = [x for x in (_repeats(r, f"{o}_{mode}_us") for o in others) if x]
                best_per_repeat = [min(ts) for ts in zip(*alts)] if alts else None
                rs = ratios(best_per_repeat, _repeats(r, f"{ours}_{mode}_us"))
                _spread(row, f"{prefix}{mode}_ratio", rs)
                row[f"{prefix}{mode}_winner"] = "gemm_ar" if mode == "graph" and wins(rs, margin) else "stock"
        rows.append(row)
    rows.sort(key=lambda r: (r["K"], r["N"], r["M"]))
    return rows


def _two_way_rows(measured: dict, stock: str, ours: str, winner: str, margin: float) -> list[dict]:
    """Per measured (M, K, N): the time under `ours` against the time under `stock` (each with its
    repeats beside it); `winner` where ours won every repeat by the margin, else "stock"."""
    out = []
    for r in measured.values():
        rs = ratios(_repeats(r, stock), _repeats(r, ours))
        row = {"M": r["M"], "K": r["K"], "N": r["N"], "shape": r["shape"], ours: r[ours], stock: r[stock],
               "winner": winner if wins(rs, margin) else "stock"}
        _spread(row, "ratio", rs)
        out.append(row)
    out.sort(key=lambda r: (r["K"], r["N"], r["M"]))
    return out


def gemv_rows(measured: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N): our GEMV against F.linear in CUDA graphs (one GPU: a rank's local
    matmul involves no peer)."""
    return _two_way_rows(measured, "cublas_us", "gemv_us", "gemv", margin)


def gemm_silu_mul_rows(measured: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N = gate | up): gate_up with SiLU-mul in the epilogue of the launch the layer
    runs at M (our decode matmul's or our GEMM's) against its unfused path and the SiLU-mul kernel, in
    CUDA graphs on one GPU (tuning/silu_mul.py). A row whose fused output
    failed its float64 check is left out: unmeasured, so stock."""
    return _two_way_rows({k: r for k, r in measured.items() if r.get("ok", True)}, "stock_ms", "fused_ms", "fused",
                         margin)


# the columns a design's rows compare: the one-launch ops as the engine calls them above its graph
# sizes (eager); the chunked ops in CUDA graphs, where the engine runs every step size they take
# (serving/worker/piecewise.graph_token_limit: eager, their ~20 host operations a call lose)
DESIGN_COLUMNS = {"kernel": ("sequential", "ours"), "chunked": ("sequential_graph", "ours_graph")}


def gemm_rows(measured: dict, margin: float = MARGIN, design: str = "kernel") -> list[dict]:
    """Per measured (op, M, K, N) of `design` (rows of the other design are left out): our AG-GEMM /
    GEMM-RS against the sequential collective + GEMM, in the design's columns (DESIGN_COLUMNS)."""
    gemm = []
    for key, r in measured.items():
        if r.get("design", "kernel") != design:
            continue
        # the CPU has no CUDA graphs: there the interpreter's eager calls (a check of the pipeline)
        stock, ours = DESIGN_COLUMNS["kernel" if r.get("graphs") is False else design]
        if not isinstance(r.get(ours), float) or not isinstance(r.get(stock), float):
            continue
        rs = ratios(_repeats(r, stock), _repeats(r, ours))
        row = {"op": r["op"], "M": r["M"], "K": r["K"], "N": r["N"], "sequential_ms": r[stock],
               "ours_ms": r[ours], "speedup": r[stock] / r[ours],
               "winner": "overlap" if wins(rs, margin) else "stock", "key": key}
        _spread(row, "ratio", rs)
        gemm.append(row)
    gemm.sort(key=lambda r: (r["op"], r["K"], r["N"], r["M"]))
    return gemm


def all_reduce_rows(measured: dict, margin: float = MARGIN) -> list[dict]:
    """Per message size: our all-reduce as "auto" runs it against NCCL, in CUDA graphs and eager (the
    phase's fused all-reduce + norm rows are the evidence's, not the table's)."""
    ar = []
    rows = sorted(message_rows(measured), key=lambda r: r["bytes"])
    crossover = one_shot_crossover(rows)
    for r in rows:
        algorithm = auto_algorithm(r, crossover)
        g, ng = r.get(f"ours_{algorithm}_graph_us"), r.get("nccl_graph_us")
        e, ne = r.get(f"ours_{algorithm}_eager_us"), r.get("nccl_eager_us")
        rg = ratios(_repeats(r, "nccl_graph_us"), _repeats(r, f"ours_{algorithm}_graph_us"))
        re_ = ratios(_repeats(r, "nccl_eager_us"), _repeats(r, f"ours_{algorithm}_eager_us"))
        row = {"bytes": r["bytes"], "ours_graph_us": g, "nccl_graph_us": ng, "ours_eager_us": e,
               "nccl_eager_us": ne, "algorithm": algorithm,
               "graph_winner": "ipc" if wins(rg, margin) else "stock",
               "eager_winner": "ipc" if wins(re_, margin) else "stock"}
        _spread(row, "graph_ratio", rg)
        _spread(row, "eager_ratio", re_)
        ar.append(row)
    return ar


def norm_rows(measured: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (hidden, tokens): the fused all-reduce + add + RMSNorm kernel against what a row layer
    runs without it, our all-reduce and then the add + norm kernel, in CUDA graphs and eager. The fused
    kernel is not faster everywhere: at TP=4 on H200 it lost at every row count of hidden 8192 (10.3 against
    8.7 us at one token) and at 256 rows of 4096 (32.4 against 20.8 us), so the table says where it runs."""
    rows = []
    for r in measured.values():
        if "tokens" not in r:
            continue
        row = {"hidden": r["hidden"], "tokens": r["tokens"]}
        for mode in ("graph", "eager"):
            row[f"fused_{mode}_us"] = r.get(f"fused_{mode}_us")
            row[f"unfused_{mode}_us"] = r.get(f"ours_then_norm_{mode}_us")
            rs = ratios(_repeats(r, f"ours_then_norm_{mode}_us"), _repeats(r, f"fused_{mode}_us"))
            row[f"{mode}_winner"] = "fused" if wins(rs, margin) else "unfused"
            _spread(row, f"{mode}_ratio", rs)
        rows.append(row)
    rows.sort(key=lambda r: (r["hidden"], r["tokens"]))
    return rows


def measured_rows(phases: dict) -> dict:
    """{phase: {key: row}} without the rows that failed (phases.failed_row: "row_failed")."""
    return {p: {k: r for k, r in rows.items() if "row_failed" not in r} for p, rows in phases.items()}


def message_rows(measured: dict) -> list[dict]:
    """The all_reduce phase's rows of the plain all-reduce (its fused all-reduce + norm rows, which have
    "tokens" and also say their bytes, are the evidence's: counted here they made rows with no time)."""
    return [r for r in measured.values() if "bytes" in r and "tokens" not in r]


def build(phases: dict, env: dict, *, command: str, margin: float = MARGIN, engine_margin: float = ENGINE_MARGIN,
          extra: dict | None = None, fused_ops: str = "auto") -> dict:
    """The table from the measurements there are, per phase as tune's store holds them ({phase: {key:
    row}}; TP=1 has no collectives: its table has the local matmuls' rows only). "gemm" and
    "all_reduce" are always there (empty where unmeasured); the other sections where their phase is,
    the engine's verdict ("engine", by `engine_margin`) too. `env`: the runs' environment (device, TP
    size, date, versions). `fused_ops`: the designs measured ("auto": options.DESIGNS), of which the
    verdict chooses one (choose_design): the table holds its fused-op rows. Rows that failed are left
    out of every section (they run stock) and listed under "failed"."""
    table = {"device": env["device"], "world": env["tp"], "date": env["date"], "torch": env["torch"],
             "triton": env["triton"]}
    if "driver" in env:
        table["driver"] = env["driver"]
    failed = sorted(({"phase": p, "key": k, "why": r["row_failed"]} for p, rows in phases.items()
                     for k, r in rows.items() if "row_failed" in r), key=lambda f: (f["phase"], f["key"]))
    # a row is measured or absent: one that failed runs stock, and the table lists it apart
    phases = measured_rows(phases)
    measured_ar = message_rows(phases.get("all_reduce", {}))
    table.update({"margin": margin,
                  "one_shot_max_bytes": one_shot_crossover(measured_ar) if measured_ar else DEFAULT_ONE_SHOT_BYTES,
                  "command": command})
    designs = DESIGNS if fused_ops == "auto" else (fused_ops,)
    design = choose_design(phases.get("engine", {}), engine_margin, designs)
    if design != "kernel":  # a table without the field holds the one-launch design's rows
        table["fused_ops"] = design
    # how each section's rows are made of its phase's measurements (which phase makes which section,
    # and which sections a table always has: tables.DISPATCH.sections)
    make = {"gemm": lambda m: gemm_rows(m, margin, design), "all_reduce": lambda m: all_reduce_rows(m, margin),
            "all_reduce_norm": lambda m: norm_rows(m, margin),
            "gemm_all_reduce": lambda m: gemm_all_reduce_rows(m, margin), "gemv": lambda m: gemv_rows(m, margin),
            "gemm_silu_mul": lambda m: gemm_silu_mul_rows(m, margin),
            "engine": lambda m: engine_rows(m, engine_margin, design)}
    for s in tables.DISPATCH.sections:
        if s.phase in phases or s.always:
            table[s.key] = make[s.key](phases.get(s.phase, {}))
    if "engine" in table:
        table["engine_margin"] = engine_margin
    if failed:
        table["failed"] = failed
    table.update(extra or {})
    return table


def design_ratios(r: dict, design: str) -> list[float]:
    """stock/flag per repeat of a step size's round with `design`'s fused ops in the sharded layout ([]
    where that design's step was not sharded, so not measured: its step is the replicated one)."""
    return ratios(_repeats(r, f"{design}_stock_ms"), _repeats(r, f"{design}_ms"))


def step_verdict(r: dict, margin: float = ENGINE_MARGIN, design: str = "kernel") -> str:
    """How a measured step size runs (one of dispatch.STEP_RUNS) in an engine of `design`: "flag" where that
    design's step in the sharded layout (its per-op choices, as the table makes them) beat the stock
    engine's by the margin in every repeat; else "replicated" where the flag's per-op choices in the
    replicated layout did (against the stock engine's times of that round; also where the design's own
    layout is the replicated one, decode sizes: a step between a replicated size and a sharded one
    then runs replicated, the cautious neighbour, as measured); else "stock", every op of the step."""
    if wins(design_ratios(r, design), margin):
        return "flag"
    if wins(ratios(_repeats(r, "replicated_stock_ms"), _repeats(r, "replicated_ms")), margin):
        return "replicated"
    return "stock"


def choose_design(measured: dict, margin: float = ENGINE_MARGIN, designs: tuple = DESIGNS) -> str:
    """The fused-op design an engine runs (it runs one): the one whose sharded step won at the most step
    sizes, then the one with the higher median stock/flag summed over the step sizes it was measured
    at; without a verdict, the first of `designs`."""
    def score(d: str):
        rs = [design_ratios(r, d) for r in measured.values()]
        return (sum(wins(x, margin) for x in rs), sum(statistics.median(x) for x in rs if x))
    return max(designs, key=score) if measured else designs[0]


def engine_rows(measured: dict, margin: float = ENGINE_MARGIN, design: str = "kernel") -> list[dict]:
    """Per model and measured step size: the stock engine's step, the flag's with each design measured
    (where its layout was sharded), and the flag's ops in the replicated layout, ms per step in CUDA
    graphs as served; the verdict ("runs") for an engine of `design`, and that design where it runs the
    flag ("design")."""
    rows = []
    for r in measured.values():
        row = {"model": r["model"], "kind": r["kind"], "M": r["tokens"], "shapes": r["shapes"],
               "layout": r["layouts"].get(design, "replicated")}
        for d in r["layouts"]:
            if f"{d}_ms" in r:
                row[d] = {"flag_ms": r[f"{d}_ms"], "stock_ms": r[f"{d}_stock_ms"]}
                _spread(row[d], "ratio", design_ratios(r, d))
        if "replicated_ms" in r:
            row.update(replicated_ms=r["replicated_ms"], replicated_stock_ms=r["replicated_stock_ms"])
            _spread(row, "replicated_ratio", ratios(_repeats(r, "replicated_stock_ms"), _repeats(r, "replicated_ms")))
        row["runs"] = step_verdict(r, margin, design)
        if row["runs"] == "flag":
            row["design"] = design
        rows.append(row)
    rows.sort(key=lambda r: (r["model"], r["M"], r["kind"]))
    return rows


def _fused_markdown(t: dict, layer_ops, layer_name: str) -> str:
    md = ""
    md += "## GEMMs (ms)\n\n" + md_table(
        ["op", "M", "K", "N", "sequential", "ours", "seq/ours", "chosen"],
        [[r["op"], r["M"], r["K"], r["N"], r["sequential_ms"], r["ours_ms"], _ratio(r, "ratio", r["speedup"]),
          r["winner"]] for r in t["gemm"]])
    d = Dispatcher(gemm=t["gemm"], margin=t["margin"])
    if layer_ops is None:
        from tp_overlap_plugin.shapes import LAYER_OPS
        from tp_overlap_plugin.tuning.shapes import shipped_dims
        layer_ops = [(LAYER_OPS[layer], k, n) for layer, k, n in shipped_dims("llama-3-8b").layers(t["world"])]
    ops = sorted(layer_ops)
    ms = sorted({r["M"] for r in t["gemm"] if (r["op"], r["K"], r["N"]) in ops})
    md += (f"\n## Layout per step size, {layer_name} layer (its four linear ops)\n\nSharded (sequence-parallel) "
           "when the layer's ops, each fused where that wins, beat the sequential total by the margin.\n\n")
    md += md_table(["M", "layout"], [[m, "sharded" if d.sequence_parallel(m, ops) else "replicated"] for m in ms])
    return md


def _all_reduce_markdown(t: dict) -> str:
    md = ""
    spread = any("graph_ratio" in r or "eager_ratio" in r for r in t["all_reduce"])
    cols = (["bytes", "ours", "ours graph", "NCCL graph"] + (["NCCL/ours graph [min–max]"] if spread else [])
            + ["chosen in graph", "ours eager", "NCCL eager"] + (["NCCL/ours eager [min–max]"] if spread else [])
            + ["chosen eager"])
    md += "\n## All-reduce (µs)\n\n" + md_table(cols, [
        [r["bytes"], r["algorithm"], r["ours_graph_us"], r["nccl_graph_us"]]
        + ([_ratio(r, "graph_ratio", "-")] if spread else [])
        + [r["graph_winner"], r["ours_eager_us"], r["nccl_eager_us"]]
        + ([_ratio(r, "eager_ratio", "-")] if spread else []) + [r["eager_winner"]] for r in t["all_reduce"]])
    return md


def engine_markdown(t: dict) -> str:
    timed = "one eager step each, CPU" if t["device"] == "cpu" else "CUDA graphs as served"
    design = t.get("fused_ops", "kernel")
    designs = [d for d in DESIGNS if any(d in r for r in t["engine"])]
    md = (f"\n## The engine's verdict: whole steps, stock engine against the flag (ms per step, {timed})"
          f"\n\nPer step size, each fused-op design's step in the sharded layout (where its layout was sharded; each "
          f"round against its own stock times) and the flag's ops in the replicated layout. The engine runs one design: "
          f"**{design}**, the one that won the most step sizes. A step size runs it sharded only where its step beat "
          f"stock's by {t['engine_margin']}x in every interleaved repeat; else the replicated layout where that did; "
          "else stock. Between measured sizes a step runs as the more cautious of its neighbours.\n\n")
    cols = ["model", "step", "tokens"]
    for d in designs:
        cols += [f"{d}: stock", f"{d}: flag", f"{d}: stock/flag"]
    cols += ["replicated: stock", "replicated", "stock/replicated", "runs"]

    def cells(r):
        out = [r["model"], r["kind"], r["M"]]
        for d in designs:
            x = r.get(d)
            out += ([x["stock_ms"], x["flag_ms"], _ratio(x, "ratio", x["stock_ms"] / x["flag_ms"])] if x
                    else ["-", "not sharded", "-"])
        rep = "replicated_ms" in r
        out += [r["replicated_stock_ms"] if rep else "-", r["replicated_ms"] if rep else "-",
                _ratio(r, "replicated_ratio", r["replicated_stock_ms"] / r["replicated_ms"]) if rep else "-",
                f"{r['runs']} ({r['design']}, sharded)" if r["runs"] == "flag" else r["runs"]]
        return out
    return md + md_table(cols, [cells(r) for r in t["engine"]])


def _ratio(row: dict, key: str, value: float):
    """A ratio cell: the median [min–max] over repeats where there were several, else the one value."""
    if key in row:
        lo, med, hi = row[key]
        return f"{med:.3f} [{lo:.3f}–{hi:.3f}]"
    return value


def markdown(t: dict, layer_ops=None, layer_name: str = "Llama-3-8B") -> str:
    """The table's evidence. `layer_ops`: one decoder layer's (op, K, N) for the layout section
    (default: Llama-3-8B's at the table's TP)."""
    md = (f"_Dispatch table for {t['device']} TP={t['world']}, from runs of {t['date']} (torch {t['torch']}, "
          f"Triton {t['triton']}). A fused op or our all-reduce is chosen only at ≥{t['margin']:.2f}x over the stock "
          f"path; our all-reduce is timed as \"auto\" runs it: one-shot up to {t['one_shot_max_bytes'] >> 10} KB, "
          f"two-shot above._\n\n")
    if t["gemm"]:  # a TP=1 table has GEMV rows only
        md += _fused_markdown(t, layer_ops, layer_name)
    if t["all_reduce"]:
        md += _all_reduce_markdown(t)
    if t.get("gemm_all_reduce"):   # (none at TP=1)
        md += ("\n## GEMM + all-reduce, decode row layers (µs)\n\nAgainst the faster of F.linear + NCCL and F.linear "
               "+ ours; `+norm`: with the residual add + RMSNorm after it, against the faster of F.linear + NCCL + "
               "norm and F.linear + our fused all-reduce + norm.\n\n")
        spread = any("graph_ratio" in r for r in t["gemm_all_reduce"])
        md += md_table(["layer", "M", "K", "N", "graph", "best stock"] + (["stock/ours [min–max]"] if spread else [])
                       + ["chosen", "graph +norm", "best stock +norm"] + (["stock/ours +norm"] if spread else [])
                       + ["chosen +norm", "eager", "chosen eager", "eager +norm", "chosen eager +norm"],
                       [[r["shape"], r["M"], r["K"], r["N"], r["graph_us"], r["graph_best_stock_us"]]
                        + ([_ratio(r, "graph_ratio", "-")] if spread else [])
                        + [r["graph_winner"], r["norm_graph_us"], r["norm_graph_best_stock_us"]]
                        + ([_ratio(r, "norm_graph_ratio", "-")] if spread else [])
                        + [r["norm_graph_winner"], r["eager_us"], r["eager_winner"], r["norm_eager_us"],
                           r["norm_eager_winner"]] for r in t["gemm_all_reduce"]])
    # (on the CPU each op is one eager call by wall clock: a smoke run of the pipeline)
    timed = "one eager call, CPU" if t["device"] == "cpu" else "CUDA graphs, one GPU"
    if t.get("engine"):
        md += engine_markdown(t)
    if t.get("failed"):
        md += ("\n## Rows that failed (they run stock; the next `tp-overlap tune` measures them again)\n\n"
               + md_table(["phase", "row", "why"], [[f["phase"], f["key"], f["why"]] for f in t["failed"]]))
    if t.get("gemm_silu_mul"):
        md += (f"\n## gate_up + SiLU-mul: the matmul + the SiLU-mul kernel against the fused launch (ms, {timed}; "
               "stock: cuBLAS, or where faster at decode rows our decode matmul)\n\n")
        md += md_table(["layer", "M", "K", "N", "stock", "fused", "stock/fused", "chosen"],
                       [[r["shape"], r["M"], r["K"], r["N"], r["stock_ms"], r["fused_ms"],
                         _ratio(r, "ratio", r["stock_ms"] / r["fused_ms"]), r["winner"]] for r in t["gemm_silu_mul"]])
    if t.get("gemv"):
        md += f"\n## Decode-sized local matmuls: our GEMV against F.linear (µs, {timed})\n\n"
        md += md_table(["layer", "M", "K", "N", "F.linear", "gemv", "F.linear/gemv", "chosen"],
                       [[r["shape"], r["M"], r["K"], r["N"], r["cublas_us"], r["gemv_us"],
                         _ratio(r, "ratio", r["cublas_us"] / r["gemv_us"]), r["winner"]] for r in t["gemv"]])
    return md
