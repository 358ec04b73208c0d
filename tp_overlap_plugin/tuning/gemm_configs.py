"""The GEMM core against cuBLAS on one GPU, and the rules that make the config table `pick_config` reads
of the measurements (`build_table`, pure). `tp-overlap tune` runs it as its gemm_configs phase and is the
one writer of the table (`tp-overlap tune --only gemm_configs` measures this phase alone; `--shapes
shipped`, every shipped model's shapes at TP = 1, 2, 4, 8: the sweep below and Qwen2.5-7B's, into the
table the package ships); the command line (tp_overlap_plugin/cli/gemm_configs.py) measures and writes
results only:

  measure (one GPU, ~4-6 min on an H200, bounded by --budget-s):
    python -m tp_overlap_plugin.cli.gemm_configs measure [--out DIR] [--budget-s 420]

measure times a compact set of candidate configs (TMA and pointer, warp-specialized, subtiled,
split-K) on every Llama-3 8B/70B linear layer at TP = 1, 2, 4, 8 (32 distinct (K, N)) and
M = 8192, 2048, 1024, 256, 64, 16, 1, side by side with cuBLAS (torch.matmul on the same
operands), B as the layers pass it: the transpose of an nn.Linear weight, a view. Large-M
candidates run at M >= 1024, small-M ones at M <= 1024. Each time is the median of 5 replays of a
CUDA graph of back-to-back calls (kernel time, not host launch cost); the calls rotate over copies
of the operands that together exceed twice the L2, so small-M shapes stream their weights from
HBM as a decode step does. Every config's output is checked against cuBLAS's first (relative
error < 1e-2). Passes run in the order above; past --budget-s the run stops and keeps what it has
(results are rewritten after every M).

Writes <out>/gemm-configs-<device>-<date>.json (raw medians, candidates, environment) and .md
(per shape: cuBLAS, the best config, ratio, the v2 pointer baseline; every candidate; the
crossover below which cuBLAS stays). `build_table` makes the table of that JSON alone;
integration_tests/test_bench_scripts.py checks that the shipped table is exactly that.

Table rules: per (M, N, K) the fastest config; for M <= 64 one config per (N, K) across those M
(the least worst ratio), since their row tiles coincide; shapes the table lacks use each M's most
frequent winner; `cublas_below` per (N, K) is the smallest measured M from which our best stays
within --margin (1.10) of cuBLAS at every larger measured M.

--dry-run: the whole pipeline on the CPU under the Triton interpreter, tiny shapes (a smoke test).
"""

from __future__ import annotations

import collections
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from tp_overlap_plugin.tuning.results import md_table

LAYOUT = "nk^T"  # B = (an nn.Linear weight [N, K]).t(), the layers' layout
M_PASSES = (8192, 2048, 1024, 256, 64, 16, 1)
LARGE_FROM = 1024   # large-M candidates at M >= this
SMALL_UPTO = 1024   # small-M candidates at M <= this
ONE_CONFIG_UPTO = 64
MARGIN = 1.10
BASELINE = "ptr 128x256x64 g16 w8 s3 flat"  # v2's pick: the pointer path this issue started from


def candidates():
    """No warp-specialized candidate: on H200 with Triton 3.6 the ones with a pointer epilogue gave
    wrong results on some shapes and not others (a race; bench/notes/gemm.md), and the descriptor-
    epilogue ones share that code path. They come back once the race is understood."""
    from tp_overlap_plugin.gemm_config import TileConfig as T
    large = [
        T(128, 256, 64, 16, 8, 3, flatten=True),                                        # v2 (pointers)
        T(128, 256, 64, 8, 8, 3, flatten=True, tma=True),                               # the TMA probe's shape
        T(128, 256, 64, 16, 8, 3, flatten=True, tma=True, c_tma=True),
        T(128, 256, 64, 8, 8, 4, flatten=True, tma=True, c_tma=True, subtile=True),     # 4 stages fit with half C
        T(128, 256, 64, 16, 8, 4, flatten=True, tma=True, subtile=True),
        T(256, 128, 64, 8, 8, 3, flatten=True, tma=True, c_tma=True),
        T(128, 128, 64, 8, 8, 4, flatten=True, tma=True, c_tma=True),                  # small N: more tiles
        T(128, 128, 128, 8, 8, 3, flatten=True, tma=True, c_tma=True),                  # short K: fewer steps
    ]
    small = [
        T(64, 128, 64, 8, 4, 4),                                                        # v2 small-M (pointers)
        T(64, 128, 128, 8, 4, 4, tma=True),
        T(64, 128, 128, 8, 4, 4, tma=True, split_k=0),
        T(64, 64, 128, 8, 4, 4, tma=True, split_k=0),
        T(64, 256, 64, 8, 4, 4, tma=True, split_k=0),
        T(128, 128, 64, 8, 4, 4, tma=True, split_k=0),
        T(64, 128, 128, 8, 4, 4, split_k=0),                                            # split-K by pointers
    ]
    return large, small


def problem_shapes(models: dict, lm_head: bool = False) -> dict:
    """{(K, N): ["8B tp2 qkv", ...]} for the linear layers of `models` ({label: (ModelDims, TP sizes)}) at
    each of its TP sizes; with `lm_head`, the LM head's vocab shard too (the decode matmul runs it)."""
    shapes = collections.defaultdict(list)
    for tp in sorted({tp for _, tps in models.values() for tp in tps}):
        for label, (dims, tps) in models.items():
            if tp in tps:
                for layer, k, n in dims.layers(tp) + ([dims.lm_head(tp)] if lm_head else []):
                    shapes[(k, n)].append(f"{label} tp{tp} {layer}")
    return dict(sorted(shapes.items()))


def llama_problem_shapes(tps):
    """The bench's sweep: the Llama-3 8B/70B linear layers (the shipped configs) at each TP."""
    from tp_overlap_plugin.tuning.shapes import shipped_dims
    return problem_shapes({"8B": (shipped_dims("llama-3-8b"), tps), "70B": (shipped_dims("llama-3-70b"), tps)})


# ---------------------------------------------------------------------------------------------
# measure

def _estimate_ms(torch, fn, device) -> float:
    if device.type != "cuda":
        return 1.0
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 3


@dataclass(frozen=True)
class MeasureRun:
    """What `measure` runs: its results directory, time budget, TP sizes, M values in the order measured,
    and the CPU dry run."""
    out: str = "."
    budget_s: float = 420.0
    tp: tuple[int, ...] = (1, 2, 4, 8)
    m: tuple[int, ...] = M_PASSES
    dry_run: bool = False


def measure(args: MeasureRun) -> None:
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from tp_overlap_plugin.tuning.results import environment, write_results
    from tp_overlap_plugin.tuning.timing import capture_stream

    t0 = time.perf_counter()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    large, small = candidates()
    shapes = llama_problem_shapes(args.tp)
    passes = args.m
    if args.dry_run:  # the pipeline, not the numbers: two scaled-down shapes
        shapes = {(96, 80): ["dry a"], (64, 200): ["dry b"]}
        passes = [m for m in passes if m <= 16] or [1]
    env = environment(args.tp, on_gpu=not args.dry_run, layout=LAYOUT, budget_s=args.budget_s, dry_run=args.dry_run)
    preflight_log: list[str] = []
    crashed = preflight_all(large + small, preflight_log, args.dry_run, workers=1 if args.dry_run else 4)
    print("\n".join(preflight_log), f"\n[{time.perf_counter() - t0:5.0f}s] preflight done; left out: {crashed or 'none'}",
          flush=True)
    large = [c for c in large if c.label() not in crashed]
    small = [c for c in small if c.label() not in crashed]
    payload = {"environment": env, "candidates": {"large": [c.to_dict() for c in large],
                                                  "small": [c.to_dict() for c in small]},
               "passes": list(passes), "results": [], "stopped": None, "crashed": crashed,
               "preflight": preflight_log}
    l2 = l2_bytes(dev)
    stream = capture_stream(dev)
    failed: dict[tuple, str] = {}  # a config that failed to build or launch fails the same way again
    gen = torch.Generator(device=dev).manual_seed(0)

    def out_of_time():
        return time.perf_counter() - t0 > args.budget_s

    for m in passes:
        cands = (large if m >= LARGE_FROM else []) + (small if m <= SMALL_UPTO else [])
        for (k, n), names in shapes.items():
            if out_of_time():
                payload["stopped"] = f"budget {args.budget_s}s reached before M={m} K={k} N={n}"
                break
            entry = measure_entry(m, k, n, names, cands, dev, stream, failed, gen, l2, dry_run=args.dry_run)
            payload["results"].append(entry)
            payload["stopped"] = entry.pop("stopped", None)
            print(f"[{time.perf_counter() - t0:5.0f}s] {entry_summary(entry)}", flush=True)
            _write(args, payload, write_results)  # a run cut off keeps what it measured
            if payload["stopped"]:
                break
        if payload["stopped"]:
            break
    payload["wall_s"] = round(time.perf_counter() - t0, 1)
    paths = _write(args, payload, write_results)
    print(f"done in {payload['wall_s']} s; wrote", *paths)


def l2_bytes(dev) -> int:
    import torch
    return getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20) if dev.type == "cuda" else 1 << 20


def measure_entry(m: int, k: int, n: int, names: list, cands: list, dev, stream, failed: dict, gen, l2: int,
                  dry_run: bool = False) -> dict:
    """One (M, K, N): cuBLAS and every candidate config (checked against cuBLAS first), kernel time
    per call. `failed` remembers configs that failed to build or launch (they fail alike again). A
    CUDA error that takes the context down sets the entry's "stopped" (the caller stops there)."""
    import torch

    from tp_overlap_plugin.ops.device import num_programs
    from tp_overlap_plugin.ops.gemm import gemm, split_slices
    from tp_overlap_plugin.tuning.timing import rotating_ms
    nbytes = 2 * (m * k + n * k + m * n)
    copies = max(1, min(32, math.ceil(2 * l2 / nbytes)))
    a = [torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    w = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k ** 0.5 for _ in range(copies)]
    b = [x.t() for x in w]
    c = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    ref = (a[0].float() @ b[0].float())
    cublas = [lambda i=i: torch.matmul(a[i], b[i], out=c[i]) for i in range(copies)]
    est = _estimate_ms(torch, cublas[0], dev)
    calls = copies * max(1, math.ceil(min(200, max(1.0, 1.0 / est)) / copies)) if not dry_run else 1
    entry = {"M": m, "K": k, "N": n, "layout": LAYOUT, "names": names, "copies": copies, "calls": calls,
             "cublas_ms": rotating_ms(cublas, calls, stream=stream), "configs": {}, "slices": {}}
    for cfg in cands:
        label = cfg.label()
        key = (label, m == 1)
        if key in failed:
            entry["configs"][label] = failed[key]
            continue
        try:
            c[0].fill_(float("nan"))
            gemm(a[0], b[0], out=c[0], config=cfg)
            err = ((c[0].float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"relative error {err:.2e} vs fp32")
            ours = [lambda i=i, cfg=cfg: gemm(a[i], b[i], out=c[i], config=cfg) for i in range(copies)]
            entry["configs"][label] = rotating_ms(ours, calls, stream=stream)
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            entry["slices"][label] = split_slices(cfg, tiles, -(-k // cfg.block_k), num_programs(dev))
        except Exception as e:  # a config that does not fit (shared memory, registers) is a data point
            msg = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            entry["configs"][label] = msg
            if not isinstance(e, AssertionError):
                failed[key] = msg
            if "CUDA error" in str(e) or "illegal" in str(e):  # the context is gone: stop, keep results
                entry["stopped"] = f"{label} at M={m} K={k} N={n}: {msg}"
                break
    return entry


def entry_summary(entry: dict) -> str:
    timed = {lb: t for lb, t in entry["configs"].items() if isinstance(t, float)}
    best = min(timed, key=timed.get) if timed else None
    t = timed.get(best, float("nan"))
    return (f"M={entry['M']} K={entry['K']} N={entry['N']} cuBLAS {entry['cublas_ms']:.4f} ms  best {best} "
            f"{t:.4f} ms ({t / entry['cublas_ms']:.3f}x)")


# (M, K, N): the sweep's specialisation (multiples of 16 and of BLOCK_K), then for small-M
# candidates the split-K and M = 1 variants, then an odd shape (ragged K, unaligned to 16 elements)
PREFLIGHT_SHAPES = [(256, 4096, 4096), (16, 4096, 4096), (1, 4096, 4096), (77, 1000, 520)]
PREFLIGHT_SHAPES_DRY = [(256, 128, 256), (16, 128, 256), (1, 128, 256), (77, 100, 40)]


def preflight(labels: list[str], dry_run: bool = False) -> None:
    """Each candidate on the preflight shapes, in this process; prints START/OK/FAIL lines as it
    goes, so the parent can name the config that took the CUDA context down with it."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from tp_overlap_plugin.ops.gemm import gemm
    large, small = candidates()
    by_label = {c.label(): c for c in large + small}
    small_labels = {c.label() for c in small}
    dev = "cpu" if dry_run else "cuda"
    ops = {}
    for m, k, n in PREFLIGHT_SHAPES_DRY if dry_run else PREFLIGHT_SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
        ops[(m, k, n)] = (a, b, a.double() @ b.double())
    for label in labels:
        print("START", label, flush=True)
        for (m, k, n), (a, b, ref) in ops.items():
            if m < 256 and m != 77 and label not in small_labels:
                continue
            shape = f"{m}x{k}x{n}"
            try:
                got = gemm(a, b, config=by_label[label]).double()
                if not dry_run:
                    torch.cuda.synchronize()
                err = ((got - ref).norm() / ref.norm()).item()
                print("OK" if err < 1e-2 else "FAIL", shape, label, f"rel_err={err:.2e}", flush=True)
            except Exception as e:
                print("FAIL", shape, label, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                      flush=True)
                if "CUDA error" in str(e) or "illegal" in str(e):
                    sys.exit(3)


def preflight_all(cands, log: list, dry_run: bool = False, workers: int = 4) -> dict[str, str]:
    """`preflight_in_subprocess` on `workers` groups of candidates at once: the child processes
    compile in parallel (the GPU work is tiny), the sweep then finds its kernels in Triton's cache."""
    from concurrent.futures import ThreadPoolExecutor
    groups = [cands[i::workers] for i in range(workers)]
    logs = [[] for _ in groups]
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda i: preflight_in_subprocess(groups[i], logs[i], dry_run), range(len(groups))))
    for part in logs:
        log += part
    return {k: v for r in results for k, v in r.items()}


def preflight_in_subprocess(cands, log: list, dry_run: bool = False) -> dict[str, str]:
    """Run `preflight` in child processes until every candidate has run; a candidate that crashes
    or hangs its process (an illegal access would poison this process's CUDA context for the whole
    sweep) or computes a wrong answer is left out of the sweep."""
    todo = [c.label() for c in cands]
    crashed = {}
    while todo:
        # the child runs `preflight` itself (labels, dry run): plumbing of this module, not a command
        cmd = [sys.executable, "-c", "import sys; from tp_overlap_plugin.tuning.gemm_configs import preflight; "
               "preflight(sys.argv[1].split('|'), sys.argv[2] == '1')", "|".join(todo), "1" if dry_run else "0"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S)
            out, err, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            def text(x):
                return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            out, err, rc = text(e.stdout), text(e.stderr), f"timeout {PREFLIGHT_TIMEOUT_S}s"
        log += out.splitlines()
        started = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("START ")]
        for line in out.splitlines():
            if line.startswith("FAIL ") and "rel_err=" in line:
                label = line.split(" ", 2)[2].rsplit(" ", 1)[0]
                crashed.setdefault(label, f"wrong result in preflight: {line}")
        if rc == 0:
            break
        culprit = started[-1] if started else todo[0]
        crashed[culprit] = f"crashed or hung its process (rc={rc}): {(err or out).strip()[-300:]}"
        print(f"preflight: {culprit} crashed; left out of the sweep", flush=True)
        todo = [lb for lb in todo if lb not in started and lb != culprit]
    return crashed


PREFLIGHT_TIMEOUT_S = 240


def _write(args, payload, write_results):
    """The results JSON and its markdown (the table's evidence); the table itself is tune's to write."""
    _, md = build_table(payload)
    stem = f"gemm-configs{'-dry-run' if args.dry_run else ''}"
    return write_results(args.out, stem, payload, md)


# ---------------------------------------------------------------------------------------------
# table (pure: results JSON -> table + markdown)

def build_table(payload: dict, margin: float = MARGIN) -> tuple[dict, str]:
    by_label = {}
    for c in payload["candidates"]["large"] + payload["candidates"]["small"]:
        from_dict = dict(c)
        by_label[_label(from_dict)] = from_dict
    rows = [r for r in payload["results"] if r["layout"] == LAYOUT]
    # Warp-specialized configs are never chosen, whatever they measured: see candidates().
    usable = {lb for lb, c in by_label.items() if not c.get("warp_spec")}
    timed = {(r["M"], r["N"], r["K"]): {lb: t for lb, t in r["configs"].items() if isinstance(t, float) and lb in usable}
             for r in rows}
    cublas = {(r["M"], r["N"], r["K"]): r["cublas_ms"] for r in rows}
    names = {(r["N"], r["K"]): r["names"] for r in rows}
    buckets = sorted({m for m, _, _ in timed})
    choice = {}
    for key, t in timed.items():
        if t:
            choice[key] = min(t, key=lambda lb: (t[lb], lb))
    # one config across the small M of each shape: their row tiles coincide, so does the best tiling
    for (n, k) in names:
        keys = [(m, n, k) for m in buckets if m <= ONE_CONFIG_UPTO and timed.get((m, n, k))]
        common = set.intersection(*(set(timed[x]) for x in keys)) if keys else set()
        if common:
            pick = min(sorted(common), key=lambda lb: max(timed[x][lb] / cublas[x] for x in keys))
            for x in keys:
                choice[x] = pick
    entries = []
    for (m, n, k), lb in sorted(choice.items()):
        ms = timed[(m, n, k)][lb]
        entries.append({"M": m, "N": n, "K": k, "label": lb, "ms": round(ms, 5),
                        "cublas_ms": round(cublas[(m, n, k)], 5), "ratio": round(ms / cublas[(m, n, k)], 4)})
    ratio = {(e["M"], e["N"], e["K"]): e["ratio"] for e in entries}
    defaults = {}
    for m in buckets:
        wins = collections.Counter(e["label"] for e in entries if e["M"] == m)
        if wins:
            mean = {lb: statistics.mean(e["ratio"] for e in entries if e["M"] == m and e["label"] == lb) for lb in wins}
            best = min(wins, key=lambda lb: (-wins[lb], mean[lb], lb))
            defaults[str(m)] = best
    crossover = []
    for (n, k) in sorted(names):
        ms_measured = [m for m in buckets if (m, n, k) in cublas]
        below = None
        for m in reversed(ms_measured):  # walk down while ours stays within the margin
            if ratio.get((m, n, k), math.inf) <= margin:
                below = m
            else:
                break
        crossover.append({"N": n, "K": k, "M": below})
    lows = [c["M"] for c in crossover]
    used = sorted({e["label"] for e in entries} | set(defaults.values()))
    env = payload["environment"]
    table = {"device": env["device"], "layout": LAYOUT, "margin": margin, "buckets": buckets,
             "configs": {lb: by_label[lb] for lb in used}, "entries": entries, "defaults": defaults,
             "cublas_below": crossover,
             "default_cublas_below": None if (not lows or None in lows) else max(lows)}
    # what the measurement ran under (tables.find compares them); runs from before tune lack them
    table.update({k: env[k] for k in ("date", "torch", "triton", "driver") if k in env})
    return table, _markdown(payload, rows, entries, crossover, margin)


def _label(d: dict) -> str:
    from tp_overlap_plugin.gemm_config import TileConfig
    return TileConfig.from_dict(d).label()


def _fmt(x, digits=3):
    return f"{x:.{digits}f}" if isinstance(x, float) else ("fail" if isinstance(x, str) else str(x))


def _markdown(payload, rows, entries, crossover, margin) -> str:
    env = payload["environment"]
    chosen = {(e["M"], e["N"], e["K"]): e for e in entries}
    timed = ("Time per call by wall clock under the Triton interpreter: a smoke run of the pipeline, not a "
             "measurement" if env["device"] == "cpu" else "Kernel time per call from CUDA-graph replays (median of 5)")
    out = [f"GEMM core vs cuBLAS, B = nn.Linear weight transposed (the layers' layout), {env['device']}. "
           f"{timed}; same run, side by side.\n"]
    if payload.get("stopped"):
        out.append(f"**Run stopped early:** {payload['stopped']}.\n")
    table_rows, hits = [], collections.Counter()
    for r in sorted(rows, key=lambda r: (-r["M"], r["K"], r["N"])):
        key = (r["M"], r["N"], r["K"])
        e = chosen.get(key)
        base = r["configs"].get(BASELINE)
        target = 1.03 if r["M"] >= 2048 else (1.10 if r["M"] >= 16 else None)
        ok = "" if e is None or target is None else ("yes" if e["ratio"] <= target else "no")
        if target is not None and e is not None:
            hits[(target, ok)] += 1
        table_rows.append([r["M"], r["K"], r["N"], ", ".join(r["names"]), r["cublas_ms"],
                           e["label"] if e else "-", e["ms"] if e else "-", e["ratio"] if e else "-",
                           target or "-", ok, _fmt(base, 4) if base is not None else "-",
                           _fmt(base / r["cublas_ms"]) if isinstance(base, float) else "-"])
    summary = ", ".join(f"{hits[(t, 'yes')]}/{hits[(t, 'yes')] + hits[(t, 'no')]} shapes within {t}x"
                        f" ({'M >= 2048' if t == 1.03 else 'M = 16-1024'})" for t in (1.03, 1.10)
                        if hits[(t, "yes")] + hits[(t, "no")])
    if summary:   # (a quick run measures no M >= 2048)
        out.append(f"Targets: {summary}.\n")
    out.append("## Per shape: the table's config vs cuBLAS (ms)\n")
    out.append(md_table(["M", "K", "N", "layers", "cuBLAS", "config", "ms", "ours/cuBLAS", "target", "met",
                         "v2 ptr ms", "v2/cuBLAS"], table_rows))
    out.append(f"\n## Crossover: cuBLAS below M (ours within {margin}x of cuBLAS from there up)\n")
    out.append(md_table(["K", "N", "layers", "cublas_below"],
                        [[c["K"], c["N"], ", ".join(next(r["names"] for r in rows if (r["N"], r["K"]) == (c["N"], c["K"]))),
                          c["M"] if c["M"] is not None else "always cuBLAS"] for c in crossover]))
    labels = list(dict.fromkeys(lb for r in rows for lb in r["configs"]))
    out.append("\n## Every candidate, ours/cuBLAS (`fail`: did not build, launch or verify; blank: not run at this M)\n")
    out.append(md_table(["M", "K", "N", "cuBLAS ms"] + labels,
                        [[r["M"], r["K"], r["N"], r["cublas_ms"]]
                         + [(_fmt(r["configs"][lb] / r["cublas_ms"]) if isinstance(r["configs"].get(lb), float)
                             else ("fail" if lb in r["configs"] else "")) for lb in labels]
                         for r in sorted(rows, key=lambda r: (-r["M"], r["K"], r["N"]))]))
    errors = sorted({(lb, t) for r in rows for lb, t in r["configs"].items() if isinstance(t, str)})
    if errors:
        out.append("\n## Failures\n")
        out.append("\n".join(f"- `{lb}`: {t}" for lb, t in errors) + "\n")
    return "\n".join(out)
