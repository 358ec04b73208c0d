"""The decode matmul's candidate configs (ops.gemv with an explicit DecodeConfig) against F.linear on
one GPU, and the config table `decode_config.pick_decode_config` reads (`tp-overlap tune`'s phase
decode_configs; the table goes into the cache, tables.cached_path("decode", device)).

Per (M, K, N): F.linear and every candidate that takes M (the FMA stream at M <= FMA_UPTO, the
swapped GEMM core's tiles at M >= MMA_FROM), µs per call in CUDA graphs whose calls rotate over weight
copies that together overflow L2 (tuning/gemv.py's method). Every candidate's output is checked
against float64 first (relative error < 1e-2); a candidate that fails to build or launch at an x tile
is recorded and skipped there for the rest of the run.

Table rule: per (M, N, K) the fastest candidate; each M's default (shapes the table lacks) is its
most frequent winner. History of the candidate list: bench/notes/decode.md (rounds 1 and 2).
"""

from __future__ import annotations

import collections

from tp_overlap_plugin.tuning.results import md_table

FMA_UPTO = 8    # FMA candidates at M <= this
MMA_FROM = 4    # tensor-core candidates at M >= this
CALLS = 20      # calls per captured graph


def candidates(device: str = "cuda") -> list:
    """Round 2 (bench/notes/decode.md): round 1's winners, 64-row tiles at 3 stages (4 stages of
    256-wide K need 256 KB at 64 rows of x), deeper rings, two warp groups; round 1's losers left out.
    The interpreter (device "cpu"): its fixed FMA and MMA configs, the pipeline's check."""
    from tp_overlap_plugin.decode_config import INTERPRETER_FMA, INTERPRETER_MMA
    from tp_overlap_plugin.decode_config import DecodeConfig as D
    if device == "cpu":
        return [INTERPRETER_FMA, INTERPRETER_MMA]
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


def takes(cfg, m: int) -> bool:
    return cfg.takes(m) and (m <= FMA_UPTO if cfg.path == "fma" else m >= MMA_FROM)


def measure_entry(m: int, k: int, n: int, names: list, cands: list, dev, stream, failed: dict, gen) -> dict:
    """One (M, K, N): F.linear and every candidate that takes M, µs per call (tuning/timing.rotating_ms
    over weight copies). `failed` remembers, per candidate and x tile, the ones that failed to build,
    launch or verify (they are not tried again)."""
    import torch
    import torch.nn.functional as F

    from tp_overlap_plugin.ops.gemv import gemv
    from tp_overlap_plugin.tuning.gemv import weight_copies
    from tp_overlap_plugin.tuning.timing import rotating_ms
    weights = weight_copies(n, k, dev, gen)
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    ref = x.double() @ weights[0].double().t()
    calls = CALLS if dev.type == "cuda" else 1  # the interpreter: one call, a smoke run
    entry = {"M": m, "K": k, "N": n, "names": names, "weight_bytes": n * k * 2,
             "cublas_us": 1e3 * rotating_ms([lambda w=w: F.linear(x, w) for w in weights], calls, stream=stream),
             "us": {}, "failed": {}}
    for c in cands:
        # a config that does not fit (shared memory) at this x tile is out for the tile's row counts
        key = f"{c.label()} @{c.tile_config(m).block_n if c.path == 'mma' else m}"
        if not takes(c, m):
            continue
        if key in failed:
            entry["failed"][c.label()] = failed[key]
            continue
        try:
            got = gemv(x, weights[0], config=c).double()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"rel err {err:.2e} at M={m} K={k} N={n}")
            entry["us"][c.label()] = 1e3 * rotating_ms([lambda w=w, c=c: gemv(x, w, config=c) for w in weights],
                                                       calls, stream=stream)
        except Exception as e:  # a candidate that fails is out for the rest of the run (at this tile)
            failed[key] = entry["failed"][c.label()] = f"{type(e).__name__}: {str(e)[:300]}"
    entry["best"] = min(entry["us"], key=entry["us"].get) if entry["us"] else None
    del weights
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def build_table(rows: list[dict], candidates: dict, env: dict, command: str) -> dict:
    """The table of measured rows: per (M, N, K) its fastest candidate, per M the most frequent winner
    as the default. `candidates`: {label: DecodeConfig.to_dict()} of every candidate measured."""
    entries, configs, winners = [], {}, collections.defaultdict(collections.Counter)
    for r in rows:
        if not r["best"]:
            continue
        configs[r["best"]] = candidates[r["best"]]
        entries.append({"M": r["M"], "N": r["N"], "K": r["K"], "label": r["best"]})
        winners[r["M"]][r["best"]] += 1
    table = {k: env[k] for k in ("device", "date", "torch", "triton", "driver") if k in env}
    table.update({"buckets": sorted(winners), "configs": configs,
                  "defaults": {str(m): c.most_common(1)[0][0] for m, c in sorted(winners.items())},
                  "entries": sorted(entries, key=lambda e: (e["M"], e["N"], e["K"])), "command": command})
    return table


def markdown(rows: list[dict], timed: str = "CUDA graphs") -> str:
    """Per (M, K, N): F.linear, the best candidate, and every candidate (µs); the failures."""
    rows = sorted(rows, key=lambda r: (r["K"], r["N"], r["M"]))
    labels = list(dict.fromkeys(lb for r in rows for lb in r["us"]))
    md = f"## Per shape: the fastest candidate against F.linear (µs per call, {timed})\n\n" + md_table(
        ["layers", "M", "K", "N", "F.linear", "best", "config", "F.linear/best"],
        [[", ".join(r["names"]), r["M"], r["K"], r["N"], r["cublas_us"], r["us"][r["best"]] if r["best"] else "-",
          r["best"] or "-", r["cublas_us"] / r["us"][r["best"]] if r["best"] else "-"] for r in rows])
    md += "\n## Every candidate (µs; blank: does not take this M)\n\n" + md_table(
        ["M", "K", "N", *labels], [[r["M"], r["K"], r["N"], *[r["us"].get(lb, "") for lb in labels]] for r in rows])
    failed = sorted({(lb, e) for r in rows for lb, e in r.get("failed", {}).items()})
    if failed:
        md += "\n## Failed candidates\n\n" + md_table(["config", "error"], [list(f) for f in failed])
    return md
