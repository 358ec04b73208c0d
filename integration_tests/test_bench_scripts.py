"""The benchmark scripts still run (on the CPU, tiny), and the shipped dispatch table is exactly what
bench/make_dispatch_table.py makes of the shipped H200 results: the table's evidence is reproducible."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def test_shipped_dispatch_table_is_reproducible(tmp_path):
    table = tmp_path / "table.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_dispatch_table.py"),
                    "--overlap", str(RESULTS / "overlap-tp2-h200x2-2026-11-22.json"),
                    "--foundation", str(RESULTS / "foundation-tp2-h200x2-2026-11-22.json"),
                    "--table-out", str(table), "--md-out", str(tmp_path / "table.md")],
                   check=True, capture_output=True, text=True, timeout=120)
    shipped = ROOT / "tp_overlap_plugin" / "dispatch_tables" / "h200-tp2.json"
    assert json.loads(table.read_text()) == json.loads(shipped.read_text())
    assert (tmp_path / "table.md").read_text() == (RESULTS / "dispatch-h200-tp2-2026-11-22.md").read_text()


@pytest.mark.timeout(400)
def test_e2e_benchmark_runs_both_engines_in_either_order(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--model", "demo", "--device", "cpu",
                        "--quick", "--tp", "2", "--order", "overlap,stock", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=380, env={**os.environ})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("e2e-demo-tp2-overlap-first-*.json")
    res = json.loads(js.read_text())
    assert res["environment"]["order"] == ["overlap", "stock"]
    for flag in ("stock", "overlap"):
        assert [s["batch"] for s in res[flag]] == [2, 4]
        assert all(s["output_tokens_per_s"] > 0 for s in res[flag])
    assert "overlap/stock" in js.with_suffix(".md").read_text()


def _gemm_bench():
    import importlib.util
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("gemm_configs_bench", ROOT / "bench" / "gemm_configs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEMM_TABLES = sorted((ROOT / "tp_overlap_plugin" / "gemm_tables").glob("*.json"))


@pytest.mark.parametrize("shipped", GEMM_TABLES, ids=[p.stem for p in GEMM_TABLES])
def test_shipped_gemm_table_is_reproducible(shipped, tmp_path):
    """The shipped GEMM config table, and the markdown beside its results, are exactly what
    bench/gemm_configs.py makes of the results JSON the table names."""
    source = RESULTS / json.loads(shipped.read_text())["source"]
    table, md = tmp_path / "table.json", tmp_path / "table.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_configs.py"), "table", str(source),
                    "--table-out", str(table), "--md-out", str(md)], check=True, capture_output=True, text=True,
                   timeout=120)
    assert table.read_text() == shipped.read_text()
    assert md.read_text() == source.with_suffix(".md").read_text()


def test_gemm_configs_pipeline_dry_run(tmp_path):
    """measure (CPU, interpreter, tiny shapes) writes results and a table; `table` rebuilds both."""
    bench = ROOT / "bench" / "gemm_configs.py"
    r = subprocess.run([sys.executable, str(bench), "measure", "--dry-run", "--m", "16,1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (js,) = tmp_path.glob("gemm-configs-dry-run-*.json")
    rebuilt, md = tmp_path / "rebuilt.json", tmp_path / "rebuilt.md"
    subprocess.run([sys.executable, str(bench), "table", str(js), "--table-out", str(rebuilt), "--md-out", str(md)],
                   check=True, capture_output=True, text=True, timeout=120)
    assert rebuilt.read_text() == (tmp_path / "gemm-table-dry-run.json").read_text()
    assert md.read_text() == js.with_suffix(".md").read_text()
    results = json.loads(js.read_text())["results"]
    assert {r["M"] for r in results} == {16, 1}
    assert all(isinstance(t, float) for r in results for t in r["configs"].values()), results


def test_gemm_table_rules():
    """Per (M, N, K) the fastest; one config across M <= 64 (least worst ratio); cuBLAS below the
    smallest M from which ours stays within the margin; each M's most frequent winner as default."""
    from tp_overlap_plugin.gemm_config import GemmTable, TileConfig
    bench = _gemm_bench()
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
    t = GemmTable.from_json(table)
    # M <= 64 share one config: X's worst ratio there is 1.5, Y's 1.6, though Y wins at M = 16
    assert t.config(1, 512, 256) == x and t.config(16, 512, 256) == x and t.config(64, 512, 256) == x
    assert t.config(2048, 512, 256) == z and t.config(2048, 1024, 256) == z
    assert t.defaults[2048] == z
    # 512x256: within 1.1x at 2048 and 64 (X 1.0), not at 16 (X 1.3): cuBLAS below 64
    assert t.prefers_cublas(63, 512, 256) and not t.prefers_cublas(64, 512, 256)
    # 1024x256: X at 1 and 16 within 1.1x, Z at 2048 0.9: ours from M = 1
    assert not t.prefers_cublas(1, 1024, 256)
    assert "cublas_below" in json.dumps(table) and "| 2048 |" in md
