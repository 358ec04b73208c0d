"""The decode matmul's candidate configs against cuBLAS on one GPU, and the config table
`decode_config.pick_decode_config` reads.

  measure (one GPU, bounded by --budget-s):
    python bench/decode_configs.py measure [--tps 1,2,4,8] [--rows 1,2,4,8,16,32,64] [--budget-s 360]
  table (CPU; rebuilds the table and its markdown from a results JSON):
    python bench/decode_configs.py table bench/results/decode-configs-<device>-<date>.json

measure times every candidate that takes the row count (the FMA stream at M <= 8, the swapped GEMM
core's tiles at M >= 4) and F.linear on every distinct local matmul shape of bench/gemv.py's models
at the given TP sizes, µs per call from CUDA graphs whose calls rotate over weight copies that
overflow L2 (bench/gemv.py's method). Every candidate's output is checked against float64 once per
shape (relative error < 1e-2); a failing or uncompilable candidate (per x tile) is recorded and skipped. Past
--budget-s the run stops after the shape in hand and keeps what it has.

Table rule: per (M, N, K) the fastest candidate; each M's default (shapes the table lacks) is its
most frequent winner. Written to tp_overlap_plugin/decode_tables/<device>.json (--table-out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (RESULTS_DIR, cycle, environment, graph_time_per_call_ms, hbm_copy_bandwidth,  # noqa: E402
                      md_table, publish)
from gemv import ROWS, shapes, weight_copies  # noqa: E402

FMA_UPTO = 8    # FMA candidates at M <= this
MMA_FROM = 4    # tensor-core candidates at M >= this


def candidates():
    """Round 2 (bench/notes/decode.md): round 1's winners, 64-row tiles at 3 stages (4 stages of 256-wide K
    need 256 KB at 64 rows of x), deeper rings, two warp groups; round 1's losers left out."""
    from tp_overlap_plugin.decode_config import DecodeConfig as D
    return [
        D("fma", 16, 256, 4, 4),                                  # the GEMV's measured tile (M <= 4)
        D("fma", 8, 512, 4, 4),                                   # fewer rows a program: more programs
        D("fma", 16, 512, 4, 3),                                  # longer K steps, same bytes in flight
        D("fma", 16, 256, 4, 6),                                  # more bytes in flight
        D("mma", 64, 256, 4, 4, tma=True),                        # one wgmma tile, 128 KB in flight (M <= 32)
        D("mma", 64, 256, 4, 3, tma=True),
        D("mma", 64, 256, 4, 3, tma=True, split_k=0),             # + split-K where tiles are few
        D("mma", 64, 128, 4, 6, tma=True, split_k=0),
        D("mma", 64, 128, 4, 6, tma=True),
        D("mma", 64, 128, 4, 8, tma=True, split_k=0),             # (M <= 32)
        D("mma", 128, 128, 4, 4, tma=True, split_k=0),
        D("mma", 128, 128, 8, 4, tma=True, split_k=0),            # two warp groups
        D("mma", 32, 256, 4, 4, tma=True),                        # mma.sync tiles: twice the programs
        D("mma", 32, 512, 4, 3, tma=True),
    ]


def _takes(cfg, m: int) -> bool:
    return cfg.takes(m) and (m <= FMA_UPTO if cfg.path == "fma" else m >= MMA_FROM)


def measure(args) -> None:
    import torch
    import torch.nn.functional as F
    from tp_overlap_plugin.overlap import gemv

    dev = torch.device("cuda")
    tps = [int(t) for t in args.tps.split(",")]
    rows = [int(m) for m in args.rows.split(",")]
    seen, shape_list = set(), []
    for tp in tps:
        for name, k, n in shapes(tp, False):
            if (k, n) not in seen:
                seen.add((k, n))
                shape_list.append((f"{name} tp{tp}", k, n))
    cands = candidates()
    gen = torch.Generator(device=dev).manual_seed(0)
    payload = {"schema": "decode-configs/1", "environment": environment(1), "hbm_copy_bytes_per_s": hbm_copy_bandwidth(),
               "command": "python bench/decode_configs.py " + " ".join(sys.argv[1:]),
               "candidates": {c.label(): c.to_dict() for c in cands}, "rows": [], "failed": {}, "stopped_at": None}
    t0 = time.time()
    for name, k, n in shape_list:
        if time.time() - t0 > args.budget_s:
            payload["stopped_at"] = name
            break
        weights = weight_copies(n, k, dev, gen)
        nxt = cycle(weights)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            ref = x.double() @ weights[0].double().t()
            row = {"shape": name, "M": m, "K": k, "N": n, "weight_bytes": n * k * 2,
                   "cublas_us": 1e3 * graph_time_per_call_ms(lambda: F.linear(x, nxt()), calls=20, samples=5),
                   "us": {}}
            for c in cands:
                label = c.label()
                # a config that does not fit (shared memory) at this x tile is out for the tile's row counts
                key = f"{label} @{c.tile_config(m).block_n if c.path == 'mma' else m}"
                if not _takes(c, m) or key in payload["failed"]:
                    continue
                try:
                    got = gemv(x, weights[0], config=c).double()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        raise AssertionError(f"rel err {err:.2e} at {name} M={m}")
                    row["us"][label] = 1e3 * graph_time_per_call_ms(lambda: gemv(x, nxt(), config=c), calls=20,
                                                                    samples=5)
                except Exception as e:  # a candidate that fails is out for the rest of the run (at this tile)
                    payload["failed"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"candidate {key} failed: {payload['failed'][key]}", flush=True)
            best = min(row["us"], key=row["us"].get) if row["us"] else None
            row["best"] = best
            payload["rows"].append(row)
            if best:
                print(f"{name:22s} M={m:2d}: cuBLAS {row['cublas_us']:7.2f} us, best {row['us'][best]:7.2f} "
                      f"({best}), {row['weight_bytes'] / row['us'][best] / 1e6:.2f} TB/s", flush=True)
        del weights, nxt
        torch.cuda.empty_cache()
    payload["seconds"] = time.time() - t0
    _write(args, payload)


def build_table(payload: dict) -> dict:
    entries, configs, winners = [], {}, collections.defaultdict(collections.Counter)
    for r in payload["rows"]:
        if not r["best"]:
            continue
        configs[r["best"]] = payload["candidates"][r["best"]]
        entries.append({"M": r["M"], "N": r["N"], "K": r["K"], "label": r["best"]})
        winners[r["M"]][r["best"]] += 1
    env = payload["environment"]
    return {"device": env["device"], "date": env["date"], "torch": env["torch"], "triton": env["triton"],
            "buckets": sorted(winners), "configs": configs,
            "defaults": {str(m): c.most_common(1)[0][0] for m, c in sorted(winners.items())},
            "entries": sorted(entries, key=lambda e: (e["M"], e["N"], e["K"])),
            "command": payload["command"]}


def markdown(payload: dict) -> str:
    bw = payload["hbm_copy_bytes_per_s"]
    labels = list(payload["candidates"])
    md = [f"# Decode matmul configs against cuBLAS (µs per call, CUDA graphs)\n", f"Command: `{payload['command']}`\n",
          f"HBM copy bandwidth (read + write, this run): {bw / 1e12:.2f} TB/s.\n"]
    table = []
    for r in payload["rows"]:
        floor = r["weight_bytes"] / bw * 1e6
        best = r["us"].get(r["best"]) if r["best"] else None
        table.append([r["shape"], r["M"], r["K"], r["N"], f"{r['weight_bytes'] / 1e6:.1f}", f"{floor:.2f}",
                      f"{r['cublas_us']:.2f}", f"{best:.2f}" if best else "-", r["best"] or "-",
                      f"{floor / best:.2f}" if best else "-", f"{floor / r['cublas_us']:.2f}",
                      f"{r['cublas_us'] / best:.2f}" if best else "-"])
    md.append(md_table(["shape", "M", "K", "N", "MB", "floor", "cuBLAS", "best", "config", "best x copy",
                        "cuBLAS x copy", "cuBLAS/best"], table))
    md.append("\n## Every candidate (µs)\n")
    md.append(md_table(["shape", "M", *labels], [[r["shape"], r["M"], *[f"{r['us'][c]:.2f}" if c in r["us"] else ""
                                                                        for c in labels]] for r in payload["rows"]]))
    if payload["failed"]:
        md.append("\n## Failed candidates\n")
        md.append(md_table(["config", "error"], [[c, e] for c, e in payload["failed"].items()]))
    if payload.get("stopped_at"):
        md.append(f"\nStopped at the budget before {payload['stopped_at']}.\n")
    return "\n".join(md)


def _write(args, payload: dict) -> None:
    from tp_overlap_plugin.decode_config import table_path
    publish(args.out, "decode-configs", payload, markdown(payload))
    out = Path(args.table_out) if args.table_out else table_path(payload["environment"]["device"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(build_table(payload), indent=1) + "\n")
    print("wrote", out)


def make_table(args) -> None:
    payload = json.loads(Path(args.results).read_text())
    _write(args, payload)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--tps", default="1,2,4,8")
    m.add_argument("--rows", default=",".join(map(str, ROWS)))
    m.add_argument("--budget-s", type=float, default=360)
    t = sub.add_parser("table")
    t.add_argument("results")
    for q in (m, t):
        q.add_argument("--out", default=RESULTS_DIR)
        q.add_argument("--table-out")
    args = p.parse_args(argv)
    measure(args) if args.cmd == "measure" else make_table(args)


if __name__ == "__main__":
    main()
