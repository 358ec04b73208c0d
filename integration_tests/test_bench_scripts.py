"""The benchmark scripts run end to end on the CPU at tiny size (stock and the flag interleaved, per-pair
ratios, the HTTP rate sweep, the fused ops' benchmark and stress run), each is named in bench/README.md
and run by a test, the README's headline table is what the newest results make, and the shipped
dispatch and GEMM tables are exactly what tuning/ makes of the shipped results (rules.build on the
stores of the tune runs that made them, gemm_configs.build_table): the tables' evidence is reproducible."""

import re

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# the runs the shipped h200-tp2 table is made of


# the shipped dispatch tables `tp-overlap tune` made, and its store of each run (every phase's rows,
# bench/results/tune-store-*): the table is what tune's rules make of them
TUNE_MADE = {"h200-tp1.json": "tune-store-llama-3-8b-tp1-h200-2026-11-28.json",
             "h200-tp4.json": "tune-store-llama-3-8b-70b-tp4-h200x4-2026-11-28-s20.json",
             "h200-tp2.json": "tune-store-llama-3-8b-tp2-h200x2-2026-11-28.json"}


@pytest.mark.parametrize("table", sorted(TUNE_MADE))
def test_shipped_dispatch_table_is_reproducible(table):
    from tp_overlap_plugin.tuning import rules
    shipped = json.loads((ROOT / "tp_overlap_plugin" / "dispatch_tables" / table).read_text())
    store = json.loads((RESULTS / TUNE_MADE[table]).read_text())
    env = {**next(iter(store.values()))["environment"], "date": shipped["date"]}
    built = rules.build({phase: data["rows"] for phase, data in store.items()}, env, command=shipped["command"],
                        extra={"models": shipped["models"], "tuned_by": "tp-overlap tune"})
    assert json.loads(json.dumps(built)) == shipped
    # and the command it names is the one that made it: tune, with its defaults (both designs measured)
    assert shipped["command"].startswith("tp-overlap tune --tp ") and "--fused-ops" not in shipped["command"]


MAX_SCRIPTS = 12  # issue 45: maintained tools only; finished instruments are retired (bench/notes/README.md)
# a test's smoke run names its script so: _run("x.py", ...) or ROOT / "bench" / "x.py"
SMOKE_RUN = re.compile(r'_run\("(\w+\.py)"|"bench" / "(\w+\.py)"')


def test_every_bench_script_is_named_and_smoke_run():
    """bench/ holds at most MAX_SCRIPTS scripts; bench/README.md names each, and no script that is gone;
    a test runs each end to end (benchlib.py, the library they share, runs inside every such run)."""
    bench = ROOT / "bench"
    scripts = sorted(p.name for p in bench.iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= MAX_SCRIPTS, f"{len(scripts)} scripts in bench/, the limit is {MAX_SCRIPTS}: {scripts}"
    readme = (bench / "README.md").read_text()
    assert [s for s in scripts if f"`{s}" not in readme and f" {s}" not in readme] == []
    listed = {line.split("`")[1].split()[0] for line in readme.splitlines() if line.startswith("| `")}
    assert {s for s in listed if s.endswith((".py", ".sh"))} <= set(scripts)
    run = {a or b for test in (ROOT / "integration_tests").glob("test_*.py")
           for a, b in SMOKE_RUN.findall(test.read_text())}
    assert [s for s in scripts if s not in run and s != "benchlib.py"] == []


def _run(script, *args, timeout=380):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.timeout(400)
def test_e2e_runs_stock_and_flag_interleaved_with_per_pair_ratios(tmp_path):
    r = _run("e2e.py", "--model", "demo", "--device", "cpu", "--quick", "--tp", "2", "--pairs", "2",
             "--order", "overlap,stock", "--min-seconds", "0.3", "--decode-requests", "4", "--out", str(tmp_path))
    # the CPU has no dispatch table: the output must say that the flag ran stock
    assert "NO DISPATCH TABLE for cpu at TP=2" in r.stdout
    (js,) = tmp_path.glob("e2e-interleaved-demo-tp2-overlap-first-*.json")
    res = json.loads(js.read_text())
    assert res["schema"] == "e2e-interleaved/1"
    assert [(run["pair"], run["engine"]) for run in res["runs"]] == [(0, "overlap"), (0, "stock"),
                                                                     (1, "overlap"), (1, "stock")]
    assert set(res["summary"]) == {"prefill-q", "decode-q", "mix-q"}
    for run in res["runs"]:
        assert run["load_s"] > 0 and run["process_s"] >= run["load_s"]
        for name, got in run["results"].items():
            # long enough: the time, or for decode the request count, whichever came first
            assert got["elapsed_s"] >= 0.3 or (name.startswith("decode") and got["num_requests"] >= 4), (name, got)
            assert got["output_tokens_per_s"] > 0
    for s in res["summary"].values():
        ratio = s["overlap_over_stock"]
        assert len(ratio["ratios"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
        assert ratio["call"].startswith("no call")  # two pairs never make a call
        assert len(s["stock"]["measured_s"]) == len(s["overlap"]["measured_s"]) == 2
    # the mix is the same long-tailed list in both engines
    mix = res["config"]["scenarios"]["mix-q"]
    assert mix["kind"] == "mix" and all(run["results"]["mix-q"]["num_requests"] % mix["requests"] == 0
                                        for run in res["runs"])
    md = js.with_suffix(".md").read_text()
    assert "overlap/stock [min–max]" in md and "NO DISPATCH TABLE" in md
    if _has_matplotlib():
        assert js.with_suffix(".png").stat().st_size > 0
    # the markdown and PNG can be redrawn from the JSON alone (the GPU machines have no matplotlib)
    js.with_suffix(".md").unlink()
    _run("e2e.py", "--replot", str(js))
    assert js.with_suffix(".md").read_text() == md

    # The README table made from this run, as if it had come from a GPU (CPU runs never count).
    sys.path.insert(0, str(ROOT / "bench"))
    import readme_table
    assert readme_table.render(str(tmp_path)).startswith("No interleaved")
    res["environment"]["device"], res["config"]["quick"] = "NVIDIA H200", False
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / js.name).write_text(json.dumps(res))
    assert readme_table.render(str(tmp_path / "gpu")).startswith("No interleaved")  # 2 pairs: no call, no row
    for s in res["summary"].values():   # as if a third pair had been measured
        s["overlap_over_stock"]["ratios"].append(s["overlap_over_stock"]["median"])
    (tmp_path / "gpu" / js.name).write_text(json.dumps(res))
    table = readme_table.render(str(tmp_path / "gpu"))
    for name, s in res["summary"].items():
        ratio = s["overlap_over_stock"]
        assert f"| {name}: {s['workload']} | demo | 2 |" in table
        assert f"{ratio['median']:.3f} [{ratio['min']:.3f}–{ratio['max']:.3f}] | {ratio['call']} |" in table


@pytest.mark.timeout(400)
def test_serve_load_sweeps_poisson_rates_with_both_servers(tmp_path):
    _run("serve_load.py", "--model", "demo", "--tp", "2", "--quick", "--pairs", "1", "--out", str(tmp_path))
    (js,) = tmp_path.glob("serve-interleaved-demo-tp2-*.json")
    res = json.loads(js.read_text())
    assert res["schema"] == "serve-interleaved/1"
    assert [(run["pair"], run["engine"]) for run in res["runs"]] == [(0, "stock"), (0, "overlap")]
    assert res["config"]["rates"] == ["4", "inf"] and res["config"]["dataset"] == "lognormal"
    for run in res["runs"]:
        assert not run.get("errors")
        for rate, lv in run["levels"].items():
            assert lv["failed"] == 0 and lv["completed"] == (6 if rate == "inf" else 4)
            assert lv["dataset_name"] == "lognormal"
            for m in ("ttft", "tpot", "itl"):
                assert 0 < lv[f"median_{m}_ms"] <= lv[f"p99_{m}_ms"]
    for s in res["summary"].values():
        assert len(s["throughput_ratio"]["ratios"]) == 1 and len(s["tpot_speedup"]["ratios"]) == 1
    md = js.with_suffix(".md").read_text()
    assert "TPOT p50 stock/overlap" in md and "ITL p99" in md
    if _has_matplotlib():
        assert js.with_suffix(".png").stat().st_size > 0


def test_serve_timeline_records_every_step_of_each_level(tmp_path):
    _run("serve_timeline.py", "--model", "demo", "--tp", "1", "--quick", "--out", str(tmp_path))
    (js,) = tmp_path.glob("serve-timeline-demo-tp1-*.json")
    res = json.loads(js.read_text())
    (run,) = res["runs"]
    for rate, lv in run["levels"].items():
        assert lv["failed"] == 0 and lv["completed"] == (6 if rate == "inf" else 4)
        steps = run["steps"][rate]
        # every prompt token and every output token but the last is computed in some step of the level
        assert sum(s["tokens"] for s in steps) == lv["total_input_tokens"] + lv["total_output_tokens"] - lv["completed"]
        tl = res["summary"][rate]["this"]["timeline"][0]
        assert tl["steps"] == len(steps) == sum(tl[k]["steps"] for k in ("prefill", "mixed", "decode"))
        assert tl["loaded_batch_min"] * 2 >= max(s["seqs"] for s in steps)
        assert 0 < tl["loaded_share_of_wall"] <= 1 and tl["loaded_decode_tok_s"] >= 0
    assert run["idle"]["requests"] == 2 and 0 < run["idle"]["ttft_ms_p50"] < run["idle"]["ttft_bound_ms"]
    assert "host-exposed share" in js.with_suffix(".md").read_text()
    if _has_matplotlib():
        assert (tmp_path / js.name.replace(".json", "-rateinf.png")).stat().st_size > 0


def test_readme_headline_table_is_generated_from_the_newest_results():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "readme_table.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"run python bench/readme_table.py: {r.stdout[-2000:]}{r.stderr[-2000:]}"


def test_pair_ratios_call_a_win_or_loss_only_when_every_pair_agrees():
    sys.path.insert(0, str(ROOT / "bench"))
    from benchlib import interleaved, pair_ratios
    assert interleaved(("stock", "overlap"), 3) == [(0, "stock"), (0, "overlap"), (1, "stock"), (1, "overlap"),
                                                     (2, "stock"), (2, "overlap")]
    win = pair_ratios([100, 100, 100], [103, 101, 102])
    assert win["call"] == "win" and win["median"] == pytest.approx(1.02) and win["spread"] == pytest.approx(1.03 / 1.01)
    assert pair_ratios([100, 100, 100], [97, 99, 98])["call"] == "loss"
    assert pair_ratios([100, 100, 100], [103, 99, 102])["call"].startswith("no call")
    assert pair_ratios([100, 100], [110, 110])["call"].startswith("no call")


def test_lognormal_workload_is_seeded_long_tailed_and_fits_the_model():
    from tp_overlap_plugin.serving.benchmarks.workloads import lognormal_lengths
    a = lognormal_lengths(2000, 256, 128, 1.0, 2048, seed=3)
    assert a == lognormal_lengths(2000, 256, 128, 1.0, 2048, seed=3) != lognormal_lengths(2000, 256, 128, 1.0, 2048, 4)
    assert all(4 <= i and 4 <= o and i + o <= 2048 for i, o in a)
    ins = sorted(i for i, _ in a)
    assert 200 < ins[len(ins) // 2] < 320        # the median is where it was asked to be
    assert ins[int(0.99 * len(ins))] > 5 * ins[len(ins) // 2]   # and the tail is long


@pytest.mark.timeout(180)
def test_bench_throughput_lognormal_repeats_rounds_until_min_seconds(tmp_path):
    from tp_overlap_plugin.cli.main import main
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", "demo", "--dataset", "lognormal", "--num-prompts", "6",
                 "--input-len", "10", "--output-len", "4", "--max-model-len", "64", "--max-concurrency", "3",
                 "--min-seconds", "0.5", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["elapsed_s"] >= 0.5 and res["num_requests"] == 6 * res.get("rounds", 1)
    assert res["dataset"] == "lognormal" and len(res["input_lens"]) == 6
    assert all(i + o <= 64 for i, o in zip(res["input_lens"], res["output_lens"]))


GEMM_CONFIGS = "tp_overlap_plugin.cli.gemm_configs"  # gemm_configs' command line: measure (results only; tune writes the table)
GEMM_TABLES = sorted((ROOT / "tp_overlap_plugin" / "gemm_tables").glob("*.json"))


@pytest.mark.parametrize("shipped", GEMM_TABLES, ids=[p.stem for p in GEMM_TABLES])
def test_shipped_gemm_table_is_reproducible(shipped):
    """The shipped GEMM config table, and the markdown beside its results, are exactly what
    tuning/gemm_configs.build_table makes of the results JSON the table names, as tables.write
    serialises it."""
    assert_gemm_table_reproducible(shipped, RESULTS)


def assert_gemm_table_reproducible(shipped, results_dir) -> None:
    """(`tune --shapes shipped` writes a table and its results this way: test_tune_shipped.py)"""
    from tp_overlap_plugin import tables
    from tp_overlap_plugin.tuning import gemm_configs
    from tp_overlap_plugin.tuning.results import header
    shipped_header = json.loads(shipped.read_text())
    source = results_dir / shipped_header["source"]
    payload = json.loads(source.read_text())
    table, md = gemm_configs.build_table(payload)
    # the provenance the table ships with: its results file, and the command that measures it again
    table.update({k: shipped_header[k] for k in ("source", "command") if k in shipped_header})
    assert tables.GEMM.dump(table) == shipped.read_text()   # the one serialiser (tables.write's)
    assert header(payload["environment"]) + md == source.with_suffix(".md").read_text()


def test_gemm_configs_pipeline_dry_run(tmp_path):
    """measure (CPU, interpreter, tiny shapes) writes the results and their markdown, the table's rules
    applied; no table (tune writes those)."""
    r = subprocess.run([sys.executable, "-m", GEMM_CONFIGS, "measure", "--dry-run", "--m", "16,1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from tp_overlap_plugin.tuning import gemm_configs
    from tp_overlap_plugin.tuning.results import header
    (js,) = tmp_path.glob("gemm-configs-dry-run-*.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([js.name, js.with_suffix(".md").name])
    payload = json.loads(js.read_text())
    table, md = gemm_configs.build_table(payload)
    assert header(payload["environment"]) + md == js.with_suffix(".md").read_text() and table["entries"]
    results = json.loads(js.read_text())["results"]
    assert {r["M"] for r in results} == {16, 1}
    assert all(isinstance(t, float) for r in results for t in r["configs"].values()), results


def test_gemm_table_rules():
    """Per (M, N, K) the fastest; one config across M <= 64 (least worst ratio); cuBLAS below the
    smallest M from which ours stays within the margin; each M's most frequent winner as default."""
    from tp_overlap_plugin.gemm_config import TileConfig, parse_table
    from tp_overlap_plugin.tuning import gemm_configs as bench
    x, y, z = TileConfig(64, 128, 128), TileConfig(64, 64, 128, split_k=0), TileConfig(128, 256, 64, flatten=True)
    X, Y, Z = x.label(), y.label(), z.label()

    def row(m, n, k, cublas, **ms):
        times = {X: ms.get("x"), Y: ms.get("y"), Z: ms.get("z")}
        return {"M": m, "N": n, "K": k, "layout": bench.LAYOUT, "names": [f"{n}x{k}"], "cublas_ms": cublas,
                "configs": {lbl: t for lbl, t in times.items() if t is not None}}

    payload = {"environment": {"device": "Test GPU"}, "stopped": None,
               "candidates": {"large": [z.to_dict()], "small": [x.to_dict(), y.to_dict()]},
               "results": [row(1, 512, 256, 1.0, x=1.5, y=1.6), row(16, 512, 256, 1.0, x=1.3, y=1.05),
                           row(64, 512, 256, 1.0, x=1.0, y=1.08), row(2048, 512, 256, 1.0, x=1.2, z=1.02),
                           row(2048, 1024, 256, 1.0, x=1.4, z=0.9), row(1, 1024, 256, 1.0, x=1.0, y=2.0),
                           row(16, 1024, 256, 1.0, x=1.0, y=2.0)]}
    table, md = bench.build_table(payload, margin=1.1)
    t = parse_table(table)
    # M <= 64 share one config: X's worst ratio there is 1.5, Y's 1.6, though Y wins at M = 16
    assert t.config(1, 512, 256) == x and t.config(16, 512, 256) == x and t.config(64, 512, 256) == x
    assert t.config(2048, 512, 256) == z and t.config(2048, 1024, 256) == z
    assert t.defaults[2048] == z
    # 512x256: within 1.1x at 2048 and 64 (X 1.0), not at 16 (X 1.3): cuBLAS below 64
    assert t.prefers_cublas(63, 512, 256) and not t.prefers_cublas(64, 512, 256)
    # 1024x256: X at 1 and 16 within 1.1x, Z at 2048 0.9: ours from M = 1
    assert not t.prefers_cublas(1, 1024, 256)
    assert "cublas_below" in json.dumps(table) and "| 2048 |" in md


def test_readme_headline_keeps_rows_a_newer_partial_run_did_not_measure(tmp_path):
    """Per (TP, model, scenario) the newest run of the flag as shipped: a newer prefill-only run replaces
    the prefill row and leaves the older run's decode row, each with its own source line; runs of a forced
    dispatch or another fused-op design never count; another model's newer run is a row of its own."""
    sys.path.insert(0, str(ROOT / "bench"))
    import readme_table

    def run(name, stamp, ratios, **config):
        summary = {scen: {"workload": scen, "stock": {"output_tokens_per_s": [100.0]},
                          "overlap": {"output_tokens_per_s": [100.0 * r]},
                          "overlap_over_stock": {"median": r, "min": r, "max": r, "ratios": [r] * 3, "call": "no call"}}
                   for scen, r in ratios.items()}
        env = {"device": "NVIDIA H200", "device_count": 2, "tp": 2, "date": stamp[:10], "timestamp": stamp,
               "torch": "t", "triton": "t"}
        cfg = {"quick": False, "dispatch": "table", "dispatch_table": "x.json", "pairs": 1, "min_seconds": 1,
               "model": "llama-3-8b", **config}
        (tmp_path / f"e2e-interleaved-{name}.json").write_text(json.dumps(
            {"schema": "e2e-interleaved/1", "environment": env, "config": cfg, "summary": summary}))

    run("old", "2026-01-01T00:00:00", {"decode-b1": 1.25, "prefill-b32": 0.95})
    run("new", "2026-01-02T00:00:00", {"prefill-b32": 1.02})
    # newer still, but not the flag as shipped: a forced dispatch, another fused-op design
    run("forced", "2026-01-03T00:00:00", {"prefill-b32": 0.5}, dispatch="overlap")
    run("chunked", "2026-01-03T00:00:00", {"decode-b1": 0.6}, fused_ops="chunked")
    run("big", "2026-01-04T00:00:00", {"prefill-b32": 1.07}, model="llama-3-70b")
    run("cut-short", "2026-01-05T00:00:00", {"decode-b1": 0.7})
    (tmp_path / "e2e-interleaved-cut-short.json").write_text((tmp_path / "e2e-interleaved-cut-short.json").read_text()
                                                             .replace('"ratios": [0.7, 0.7, 0.7]', '"ratios": [0.7]'))
    table = readme_table.render(str(tmp_path))
    rows = [line for line in table.splitlines() if line.startswith("| prefill") or line.startswith("| decode")]
    assert rows[0].startswith("| prefill-b32") and "| llama-3-70b |" in rows[0] and "1.070" in rows[0]
    assert rows[1].startswith("| prefill-b32") and "| llama-3-8b |" in rows[1] and "1.020" in rows[1]
    assert "0.950" not in table and "0.700" not in table   # one pair: no call, no headline row
    assert rows[2].startswith("| decode-b1") and "1.250" in rows[2]
    assert "e2e-interleaved-old.json" in table and "e2e-interleaved-new.json" in table


@pytest.mark.timeout(300)
def test_overlap_bench_smoke_run_measures_each_variant_and_the_all_reduce(tmp_path):
    """bench/overlap.py on the CPU (interpreter, eager, two tiny shapes): every variant of each fused op
    timed, ours checked against the sequential result, the all-reduce row, the markdown."""
    _run("overlap.py", "--tp", "2", "--device", "cpu", "--out", str(tmp_path), timeout=280)
    (js,) = tmp_path.glob("overlap-tp2-cpu-*.json")
    res = json.loads(js.read_text())
    assert res["errors"] == [] and res["environment"]["device"] == "cpu"
    assert [(r["op"], r["M"]) for r in res["shapes"].values()] == [("ag", 4), ("rs", 4)]
    for r in res["shapes"].values():
        assert r["ours_rel_err"] < 1e-2, r
        assert all(r[v] > 0 for v in ("cublas", "nccl", "sequential", "triton_gemm", "ours", "floor")), r
    (ar,) = res["all_reduce"]
    assert ar["bytes"] == 8 << 10 and ar["one_shot_rel_err"] < 1e-2 and ar["two_shot_eager_us"] > 0, ar
    assert "## Llama TP shapes (ms)" in js.with_suffix(".md").read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("design", ["kernel", "chunked"])
def test_overlap_stress_smoke_run_checks_every_call(tmp_path, design):
    """bench/overlap_stress.py on the CPU (interpreter, eager only, tiny shapes), each design: every call
    checked against the fp32 reference, both ops drawn, no mismatch and no call that fell back to the
    stock path (the script exits 1 on either)."""
    _run("overlap_stress.py", "--tp", "2", "--device", "cpu", "--calls", "6", "--fused-ops", design,
         "--out", str(tmp_path), timeout=280)
    (js,) = tmp_path.glob("overlap-stress-tp2-cpu-*.json" if design == "kernel" else "overlap-stress-tp2-chunked-cpu-*.json")
    res = json.loads(js.read_text())
    assert set(res) >= {"eager"} and "graph" not in res and res["fused_ops"] == design
    assert res["eager"]["mismatches"] == 0 and res["eager"]["max_rel_err"] < res["tolerance"]
    assert res["eager"]["fallbacks"] == 0
    for rank in res["per_rank"]:
        assert rank["eager"]["calls"] == 6 and rank["eager"]["ag_calls"] + rank["eager"]["rs_calls"] == 6
    assert res["shapes"] == {"ag": [64, 48], "rs": [32, 64]} and res["max_rows"] == 8
