"""Turn measured runs into the dispatcher's table (tp_overlap_plugin/dispatch_tables/<device>-tp<W>.json)
and a markdown copy in bench/results/ that shows the evidence for every choice. The rules are
tp_overlap_plugin/tuning/rules.py's (the ones `tp-overlap tune` applies to its own measurements), on the
runs' rows put as tune's store holds them:

    python bench/make_dispatch_table.py --overlap bench/results/overlap-tp2-h200x2-2026-11-22.json \
        --foundation bench/results/foundation-tp2-h200x2-2026-11-22.json \
        [--gemm-ar bench/results/gemm-ar-tp2-h200x2-<date>.json] [--gemv bench/results/gemv-tp2-h200-<date>.json]

Without --gemm-ar the table has no GEMM + all-reduce rows, and the dispatcher never picks it; without
--gemv no GEMV rows, and every decode-sized local matmul stays F.linear.

At TP=1 nothing is communicated: the table is the decode matmul's rows alone,

    python bench/make_dispatch_table.py --gemv bench/results/gemv-tp1-h200-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import RESULTS_DIR  # noqa: E402

from tp_overlap_plugin.dispatch import table_path  # noqa: E402
from tp_overlap_plugin.tuning.rules import build, markdown  # noqa: E402


BENCH_COMMAND = ("python bench/overlap.py --tp W && python bench/foundation.py --tp W && "
                 "python bench/make_dispatch_table.py --overlap ... --foundation ...")
TP1_COMMAND = "python bench/gemv.py --tp 1 && python bench/make_dispatch_table.py --gemv ..."


def _same_machine(flag: str, run: dict, env: dict) -> None:
    renv = run["environment"]
    if (renv["device"], renv["tp"]) != (env["device"], env["tp"]):
        raise ValueError(f"{flag} ran on {renv['device']} at TP={renv['tp']}, --overlap on {env['device']} "
                         f"at TP={env['tp']}: one table is for one device and world size")


def table_of(overlap: dict | None, foundation: dict | None, gemm_ar: dict | None = None,
             gemv: dict | None = None) -> dict:
    """The table of bench runs: their rows put as tune's store holds them ({phase: {key: row}}), then
    tuning/rules.build. Without an overlap run (TP=1) the environment is the gemv run's."""
    env = overlap["environment"] if overlap is not None else gemv["environment"]
    phases, command = {}, BENCH_COMMAND if overlap is not None else TP1_COMMAND
    if overlap is not None:
        phases["fused_ops"] = {**overlap.get("shapes", {}), **overlap.get("sweep", {})}
    if foundation is not None:
        phases["all_reduce"] = {f"ar/{r['bytes']}": r for r in foundation["rank0"]["all_reduce"]}
    for flag, run, phase in (("--gemm-ar", gemm_ar, "gemm_ar"), ("--gemv", gemv, "gemv")):
        if run is None:
            continue
        if overlap is not None:
            _same_machine(flag, run, env)
            command += f" {flag} ... (python bench/{phase}.py --tp W)"
        phases[phase] = {f"{r['shape']}/{r['M']}x{r['K']}x{r['N']}": r for r in run["rows"]}
    return build(phases, env, command=command)


def _load(path):
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--overlap", help="a bench/overlap.py run (required above TP=1)")
    p.add_argument("--foundation", help="a bench/foundation.py run of the same device and TP size (required above TP=1)")
    p.add_argument("--gemm-ar", help="a bench/gemm_ar.py run of the same device and TP size")
    p.add_argument("--gemv", help="a bench/gemv.py run of the same device and TP size")
    p.add_argument("--table-out", help="default: the package's table for the run's device and TP size")
    p.add_argument("--md-out", help="default: bench/results/dispatch-<device>-tp<W>-<date>.md")
    args = p.parse_args(argv)
    overlap, foundation, gemv = _load(args.overlap), _load(args.foundation), _load(args.gemv)
    if overlap is None or foundation is None:
        # a TP=1 table: a rank's local matmuls are its only ops (no heap, no peers)
        if gemv is None or gemv["environment"]["tp"] != 1 or overlap or foundation or args.gemm_ar:
            p.error("--overlap and --foundation are required, except for a TP=1 table, which is a TP=1 --gemv run "
                    "alone")
        table = table_of(None, None, gemv=gemv)
    else:
        table = table_of(overlap, foundation, _load(args.gemm_ar), gemv)
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
