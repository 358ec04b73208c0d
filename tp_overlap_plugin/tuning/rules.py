"""The dispatcher's table from measurements: the one copy of its decision rules ("never slower than
stock"). `build` takes the measurements in the formats of the sweeps that make them (fused_ops rows
as bench/overlap.py writes them, allreduce rows as bench/foundation.py does, gemm_ar and gemv rows);
`tp-overlap tune` and bench/make_dispatch_table.py both call it.

A row picks ours only when ours wins by MARGIN (the run-to-run noise seen here is ~2%) in every
interleaved repeat: with repeats, each repeat's ratio stock/ours must reach the margin, and the table
keeps the ratios' median and spread ("ratio": [min, median, max]); a run of one repeat (the older
bench results) has one ratio.
"""

from __future__ import annotations

import statistics

from tp_overlap_plugin.collectives import DEFAULT_ONE_SHOT_BYTES
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.tuning.results import md_table

MARGIN = 1.02
# The engine's all-reduce runs algorithm "auto": one-shot up to the op's one-shot limit (collectives.
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


def auto_algorithm(r: dict) -> str:
    """The kernel "auto" runs at this size; runs from before two-shot was measured have the one-shot
    only, which "auto" then was."""
    return "two_shot" if r["bytes"] > DEFAULT_ONE_SHOT_BYTES and "ours_two_shot_graph_us" in r else "one_shot"


def gemm_all_reduce_rows(gemm_ar: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N): GEMM + all-reduce against the faster of what runs without it (F.linear
    + NCCL or + our all-reduce; with the norm after it, + NCCL + norm or + our fused all-reduce +
    norm), in CUDA graphs and eager. A mode that was not measured is "stock".

    Eagerly it is always "stock": there every variant is launch-bound (47-190 us for kernels of
    7-70 us on H200x2, 2026-11-23) and the same variant scatters more between neighbouring M than
    the variants differ, so an eager "win" would be noise. Decode steps, where this op applies,
    run in CUDA graphs."""
    rows = []
    for r in gemm_ar["rows"]:
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


def _two_way_rows(rows: list[dict], stock: str, ours: str, winner: str, margin: float) -> list[dict]:
    """Per measured (M, K, N): the time under `ours` against the time under `stock` (each with its
    repeats beside it); `winner` where ours won every repeat by the margin, else "stock"."""
    out = []
    for r in rows:
        rs = ratios(_repeats(r, stock), _repeats(r, ours))
        row = {"M": r["M"], "K": r["K"], "N": r["N"], "shape": r["shape"], ours: r[ours], stock: r[stock],
               "winner": winner if wins(rs, margin) else "stock"}
        _spread(row, "ratio", rs)
        out.append(row)
    out.sort(key=lambda r: (r["K"], r["N"], r["M"]))
    return out


def gemv_rows(gemv: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N): our GEMV against F.linear in CUDA graphs (one GPU: a rank's local
    matmul involves no peer)."""
    return _two_way_rows(gemv["rows"], "cublas_us", "gemv_us", "gemv", margin)


def gemm_silu_mul_rows(run: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (M, K, N = gate | up): gate_up with SiLU-mul in our GEMM's epilogue against cuBLAS
    and the SiLU-mul kernel, in CUDA graphs on one GPU (bench/gemm_silu_mul.py)."""
    return _two_way_rows(run["rows"], "stock_ms", "fused_ms", "fused", margin)


def _same_machine(flag: str, run: dict, env: dict) -> None:
    renv = run["environment"]
    if (renv["device"], renv["tp"]) != (env["device"], env["tp"]):
        raise ValueError(f"{flag} ran on {renv['device']} at TP={renv['tp']}, --overlap on {env['device']} "
                         f"at TP={env['tp']}: one table is for one device and world size")


def gemm_rows(overlap: dict, margin: float = MARGIN) -> list[dict]:
    """Per measured (op, M, K, N): our AG-GEMM / GEMM-RS against the sequential collective + GEMM."""
    gemm = []
    for key, r in {**overlap.get("shapes", {}), **overlap.get("sweep", {})}.items():
        if not isinstance(r.get("ours"), float) or not isinstance(r.get("sequential"), float):
            continue
        rs = ratios(_repeats(r, "sequential"), _repeats(r, "ours"))
        row = {"op": r["op"], "M": r["M"], "K": r["K"], "N": r["N"], "sequential_ms": r["sequential"],
               "ours_ms": r["ours"], "speedup": r["sequential"] / r["ours"],
               "winner": "overlap" if wins(rs, margin) else "stock", "key": key}
        _spread(row, "ratio", rs)
        gemm.append(row)
    gemm.sort(key=lambda r: (r["op"], r["K"], r["N"], r["M"]))
    return gemm


def all_reduce_rows(all_reduce: list[dict], margin: float = MARGIN) -> list[dict]:
    """Per message size: our all-reduce as "auto" runs it against NCCL, in CUDA graphs and eager."""
    ar = []
    for r in all_reduce:
        algorithm = auto_algorithm(r)
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


def build(overlap: dict | None, foundation: dict | None, gemm_ar: dict | None = None, gemv: dict | None = None,
          *, env: dict | None = None, margin: float = MARGIN, command: str | None = None,
          extra: dict | None = None) -> dict:
    """The table from the measurements there are (TP=1 has no collectives: gemv rows only). `env`:
    the run's environment (default: the overlap run's)."""
    env = env or overlap["environment"]
    table = {"device": env["device"], "world": env["tp"], "date": env["date"], "torch": env["torch"],
             "triton": env["triton"]}
    if "driver" in env:
        table["driver"] = env["driver"]
    table.update({"margin": margin, "one_shot_max_bytes": DEFAULT_ONE_SHOT_BYTES,
                  "gemm": gemm_rows(overlap, margin) if overlap else [],
                  "all_reduce": all_reduce_rows(foundation["rank0"]["all_reduce"], margin) if foundation else [],
                  "command": command or "python bench/overlap.py --tp W && python bench/foundation.py --tp W && "
                                        "python bench/make_dispatch_table.py --overlap ... --foundation ..."})
    for flag, run, key, rows, script in (("--gemm-ar", gemm_ar, "gemm_all_reduce", gemm_all_reduce_rows, "gemm_ar"),
                                         ("--gemv", gemv, "gemv", gemv_rows, "gemv")):
        if run is None:
            continue
        if overlap is not None:
            _same_machine(flag, run, env)
        table[key] = rows(run, margin)
        if command is None:
            table["command"] += f" {flag} ... (python bench/{script}.py --tp W)"
    table.update(extra or {})
    return table


def _fused_markdown(t: dict, layer_ops, layer_name: str) -> str:
    md = ""
    md += "## GEMMs (ms)\n\n" + md_table(
        ["op", "M", "K", "N", "sequential", "ours", "seq/ours", "chosen"],
        [[r["op"], r["M"], r["K"], r["N"], r["sequential_ms"], r["ours_ms"], _ratio(r, "ratio", r["speedup"]),
          r["winner"]] for r in t["gemm"]])
    d = Dispatcher(gemm=t["gemm"], margin=t["margin"])
    if layer_ops is None:
        from tp_overlap_plugin.tuning.shapes import LAYER_OPS, shipped_dims
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
    if t.get("gemv"):
        # (on the CPU each op is one eager call by wall clock: a smoke run of the pipeline)
        timed = "one eager call, CPU" if t["device"] == "cpu" else "CUDA graphs, one GPU"
        md += f"\n## Decode-sized local matmuls: our GEMV against F.linear (µs, {timed})\n\n"
        md += md_table(["layer", "M", "K", "N", "F.linear", "gemv", "F.linear/gemv", "chosen"],
                       [[r["shape"], r["M"], r["K"], r["N"], r["cublas_us"], r["gemv_us"],
                         _ratio(r, "ratio", r["cublas_us"] / r["gemv_us"]), r["winner"]] for r in t["gemv"]])
    return md
