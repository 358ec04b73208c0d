"""Turn measured runs into the dispatcher's table (tp_overlap_plugin/dispatch_tables/<device>-tp<W>.json)
and a markdown copy in bench/results/ that shows the evidence for every choice:

    python bench/make_dispatch_table.py --overlap bench/results/overlap-tp2-h200x2-2026-11-22.json \
        --foundation bench/results/foundation-tp2-h200x2-2026-11-22.json \
        [--gemm-ar bench/results/gemm-ar-tp2-h200x2-<date>.json] [--gemv bench/results/gemv-tp2-h200-<date>.json]

Without --gemm-ar the table has no GEMM + all-reduce rows, and the dispatcher never picks it; without
--gemv no GEMV rows, and every decode-sized local matmul stays F.linear.

At TP=1 nothing is communicated: the table is the decode matmul's rows alone,

    python bench/make_dispatch_table.py --gemv bench/results/gemv-tp1-h200-<date>.json

A fused op wins only if it beats sequential by MARGIN (the run-to-run noise seen here is ~2%), so
"never slower than stock" holds with that margin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import RESULTS_DIR, md_table  # noqa: E402

from overlap import llama_shapes  # noqa: E402

from tp_overlap_plugin.collectives import DEFAULT_ONE_SHOT_BYTES  # noqa: E402
from tp_overlap_plugin.dispatch import Dispatcher, table_path  # noqa: E402

MARGIN = 1.02
# The engine's all-reduce runs algorithm "auto": one-shot up to the op's one-shot limit (collectives.
# DEFAULT_ONE_SHOT_BYTES), two-shot above; so that is the time the table compares with NCCL. Each rank
# of a one-shot reads every peer's whole message, W - 1 times a ring's traffic: with v1 at 2 MB it won
# in a CUDA graph on idle links (21.8 vs 29.5 us) yet cost 7% of decode throughput at batch 256 end to
# end (bench/results/e2e-llama-3-8b-tp2-h200x2-2026-11-22-ipc2mb.md). Two-shot moves what a ring moves.


def auto_algorithm(r: dict) -> str:
    """The kernel "auto" runs at this size; runs from before two-shot was measured have the one-shot
    only, which "auto" then was."""
    return "two_shot" if r["bytes"] > DEFAULT_ONE_SHOT_BYTES and "ours_two_shot_graph_us" in r else "one_shot"


def gemm_all_reduce_rows(gemm_ar: dict) -> list[dict]:
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
                row[f"{prefix}{mode}_winner"] = ("gemm_ar" if mode == "graph" and t and best and best / t >= MARGIN
                                                 else "stock")
        rows.append(row)
    rows.sort(key=lambda r: (r["K"], r["N"], r["M"]))
    return rows


def gemv_rows(gemv: dict) -> list[dict]:
    """Per measured (M, K, N): our GEMV against F.linear in CUDA graphs (one GPU: a rank's local
    matmul involves no peer)."""
    rows = [{"M": r["M"], "K": r["K"], "N": r["N"], "shape": r["shape"], "gemv_us": r["gemv_us"],
             "cublas_us": r["cublas_us"], "winner": "gemv" if r["cublas_us"] / r["gemv_us"] >= MARGIN else "stock"}
            for r in gemv["rows"]]
    rows.sort(key=lambda r: (r["K"], r["N"], r["M"]))
    return rows


def _same_machine(flag: str, run: dict, env: dict) -> None:
    renv = run["environment"]
    if (renv["device"], renv["tp"]) != (env["device"], env["tp"]):
        raise ValueError(f"{flag} ran on {renv['device']} at TP={renv['tp']}, --overlap on {env['device']} "
                         f"at TP={env['tp']}: one table is for one device and world size")


def build_local(gemv: dict) -> dict:
    """The TP=1 table: a rank's local matmuls are its only ops (no heap, no peers)."""
    env = gemv["environment"]
    if env["tp"] != 1:
        raise ValueError(f"--gemv alone makes a TP=1 table; this run is TP={env['tp']}: add --overlap and "
                         f"--foundation of that TP size")
    return {"device": env["device"], "world": 1, "date": env["date"], "torch": env["torch"], "triton": env["triton"],
            "margin": MARGIN, "one_shot_max_bytes": DEFAULT_ONE_SHOT_BYTES, "gemm": [], "all_reduce": [],
            "gemv": gemv_rows(gemv),
            "command": "python bench/gemv.py --tp 1 && python bench/make_dispatch_table.py --gemv ..."}


def build(overlap: dict, foundation: dict, gemm_ar: dict | None = None, gemv: dict | None = None) -> dict:
    env = overlap["environment"]
    gemm = []
    for key, r in {**overlap.get("shapes", {}), **overlap.get("sweep", {})}.items():
        if not isinstance(r.get("ours"), float) or not isinstance(r.get("sequential"), float):
            continue
        ratio = r["sequential"] / r["ours"]
        gemm.append({"op": r["op"], "M": r["M"], "K": r["K"], "N": r["N"], "sequential_ms": r["sequential"],
                     "ours_ms": r["ours"], "speedup": ratio, "winner": "overlap" if ratio >= MARGIN else "stock",
                     "key": key})
    gemm.sort(key=lambda r: (r["op"], r["K"], r["N"], r["M"]))
    ar = []
    for r in foundation["rank0"]["all_reduce"]:
        algorithm = auto_algorithm(r)
        g, ng = r.get(f"ours_{algorithm}_graph_us"), r.get("nccl_graph_us")
        e, ne = r.get(f"ours_{algorithm}_eager_us"), r.get("nccl_eager_us")
        ar.append({"bytes": r["bytes"], "ours_graph_us": g, "nccl_graph_us": ng, "ours_eager_us": e,
                   "nccl_eager_us": ne, "algorithm": algorithm,
                   "graph_winner": "ipc" if g and ng and ng / g >= MARGIN else "stock",
                   "eager_winner": "ipc" if e and ne and ne / e >= MARGIN else "stock"})
    table = {"device": env["device"], "world": env["tp"], "date": env["date"], "torch": env["torch"],
             "triton": env["triton"], "margin": MARGIN, "one_shot_max_bytes": DEFAULT_ONE_SHOT_BYTES, "gemm": gemm,
             "all_reduce": ar,
             "command": "python bench/overlap.py --tp W && python bench/foundation.py --tp W && "
                        "python bench/make_dispatch_table.py --overlap ... --foundation ..."}
    if gemm_ar is not None:
        _same_machine("--gemm-ar", gemm_ar, env)
        table["gemm_all_reduce"] = gemm_all_reduce_rows(gemm_ar)
        table["command"] += " --gemm-ar ... (python bench/gemm_ar.py --tp W)"
    if gemv is not None:
        _same_machine("--gemv", gemv, env)
        table["gemv"] = gemv_rows(gemv)
        table["command"] += " --gemv ... (python bench/gemv.py --tp W)"
    return table


def markdown(t: dict) -> str:
    md = (f"_Dispatch table for {t['device']} TP={t['world']}, from runs of {t['date']} (torch {t['torch']}, "
          f"Triton {t['triton']}). A fused op or our all-reduce is chosen only at ≥{t['margin']:.2f}x over the stock "
          f"path; our all-reduce is timed as \"auto\" runs it: one-shot up to {t['one_shot_max_bytes'] >> 10} KB, "
          f"two-shot above._\n\n")
    if t["world"] == 1:
        return md + _gemv_markdown(t)
    md += "## GEMMs (ms)\n\n" + md_table(
        ["op", "M", "K", "N", "sequential", "ours", "seq/ours", "chosen"],
        [[r["op"], r["M"], r["K"], r["N"], r["sequential_ms"], r["ours_ms"], r["speedup"], r["winner"]]
         for r in t["gemm"]])
    d = Dispatcher(gemm=t["gemm"], margin=t["margin"])
    ops = sorted((op, k, n) for model, _, op, k, n in llama_shapes(t["world"]) if model == "8B")
    ms = sorted({r["M"] for r in t["gemm"] if (r["op"], r["K"], r["N"]) in ops})
    md += ("\n## Layout per step size, Llama-3-8B layer (its four linear ops)\n\nSharded (sequence-parallel) "
           "when the layer's ops, each fused where that wins, beat the sequential total by the margin.\n\n")
    md += md_table(["M", "layout"], [[m, "sharded" if d.sequence_parallel(m, ops) else "replicated"] for m in ms])
    md += "\n## All-reduce (µs)\n\n" + md_table(
        ["bytes", "ours", "ours graph", "NCCL graph", "chosen in graph", "ours eager", "NCCL eager", "chosen eager"],
        [[r["bytes"], r["algorithm"], r["ours_graph_us"], r["nccl_graph_us"], r["graph_winner"], r["ours_eager_us"],
          r["nccl_eager_us"], r["eager_winner"]] for r in t["all_reduce"]])
    if "gemm_all_reduce" in t:
        md += ("\n## GEMM + all-reduce, decode row layers (µs)\n\nAgainst the faster of F.linear + NCCL and F.linear "
               "+ ours; `+norm`: with the residual add + RMSNorm after it, against the faster of F.linear + NCCL + "
               "norm and F.linear + our fused all-reduce + norm.\n\n")
        md += md_table(["layer", "M", "K", "N", "graph", "best stock", "chosen", "graph +norm", "best stock +norm",
                        "chosen +norm", "eager", "chosen eager", "eager +norm", "chosen eager +norm"],
                       [[r["shape"], r["M"], r["K"], r["N"], r["graph_us"], r["graph_best_stock_us"], r["graph_winner"],
                         r["norm_graph_us"], r["norm_graph_best_stock_us"], r["norm_graph_winner"], r["eager_us"],
                         r["eager_winner"], r["norm_eager_us"], r["norm_eager_winner"]] for r in t["gemm_all_reduce"]])
    return md + _gemv_markdown(t)


def _gemv_markdown(t: dict) -> str:
    if "gemv" not in t:
        return ""
    return ("\n## Decode-sized local matmuls: our GEMV against F.linear (µs, CUDA graphs, one GPU)\n\n" +
            md_table(["layer", "M", "K", "N", "F.linear", "gemv", "F.linear/gemv", "chosen"],
                     [[r["shape"], r["M"], r["K"], r["N"], r["cublas_us"], r["gemv_us"], r["cublas_us"] / r["gemv_us"],
                       r["winner"]] for r in t["gemv"]]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--overlap", help="a bench/overlap.py run (required at TP > 1)")
    p.add_argument("--foundation", help="a bench/foundation.py run (required at TP > 1)")
    p.add_argument("--gemm-ar", help="a bench/gemm_ar.py run of the same device and TP size")
    p.add_argument("--gemv", help="a bench/gemv.py run of the same device and TP size")
    p.add_argument("--table-out", help="default: the package's table for the run's device and TP size")
    p.add_argument("--md-out", help="default: bench/results/dispatch-<device>-tp<W>-<date>.md")
    args = p.parse_args(argv)
    if not (args.overlap and args.foundation) and not (args.gemv and not args.overlap and not args.foundation):
        p.error("give --overlap and --foundation (TP > 1), or --gemv alone (a TP=1 table)")
    gemm_ar = None
    if args.gemm_ar:
        with open(args.gemm_ar) as f:
            gemm_ar = json.load(f)
    gemv = None
    if args.gemv:
        with open(args.gemv) as f:
            gemv = json.load(f)
    if args.overlap:
        with open(args.overlap) as f:
            overlap = json.load(f)
        with open(args.foundation) as f:
            foundation = json.load(f)
        table = build(overlap, foundation, gemm_ar, gemv)
    else:
        table = build_local(gemv)
    out = Path(args.table_out) if args.table_out else table_path(table["device"], table["world"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    md_path = args.md_out or os.path.join(RESULTS_DIR, f"dispatch-{out.stem}-{table['date']}.md")
    with open(md_path, "w") as f:
        f.write(markdown(table))
    print(markdown(table))
    print("wrote", out, md_path)


if __name__ == "__main__":
    main()
