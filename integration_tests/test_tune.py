"""`tp-overlap tune` on the CPU (2 ranks, the interpreter, the demo model) writes the flag's tables into
the per-user cache, and a server started with `--tp-overlap` takes them from there and runs our kernels;
the lookup order (explicit, cache, shipped, none), and a corrupt, stale, other-device or unwritable
table each get a clear message and never fail a start; two runs at once leave one valid file that
holds both runs' rows.

Under the interpreter our kernels never beat torch, so the run passes `--margin 0`: every row whose
kernel ran correctly picks ours, which is what lets the server prove the tables reached it. Its engine
check (the demo's steps, stock against the flag) runs for real, its times replaced by a test hook
(FAKE_STEP_MS, through the real decision rules): the flag wins at 1 and 8 tokens and loses at 16 (the
budget), where it then loses replicated too, so 16-token steps are served stock."""

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from tp_overlap_plugin import tables
from tp_overlap_plugin.dispatch import Dispatcher

pytestmark = pytest.mark.timeout(300)


# the engine check's step times (ms) by the test hook, per step size: stock, each design's sharded step
# and the replicated layout's. 8 tokens: both designs win, chunked more (so the verdict chooses it); 16:
# everything loses (stock); 1 token: not sharded in either design, the replicated layout wins
FAKE_STEP_MS = {"decode/1": {"stock": 2.0, "replicated": 1.0},
                "prefill/8": {"stock": 2.0, "kernel": 1.5, "chunked": 1.0, "replicated": 2.0},
                "prefill/16": {"stock": 1.0, "kernel": 2.0, "chunked": 2.0, "replicated": 2.0}}
# rows made to fail on purpose (the test hook of tuning/phases.py): a fused all-reduce + norm row's check
# fails on every rank; the last rank dies while it measures a one-launch GEMM-RS row. tune goes on, those
# rows are left out (stock) and listed, and the rest of the table is whole
FAIL = {"all_reduce/norm/128x1": "check", "fused_ops/rs/4x64x128": "crash"}
DEMO_OPS = (("ag", 128, 128), ("ag", 128, 256), ("rs", 64, 128), ("rs", 128, 128))  # the demo's at TP=2


def _tune(cache: Path, *args, timeout=240, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    env["TP_OVERLAP_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "tp_overlap_plugin.cli", "tune", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # a budget no CI machine reaches: the test is of the pipeline, not of the budget
    proc = _tune(cache, "--tp", "2", "--quick", "--device", "cpu", "--model", "demo", "--margin", "0",
                 "--engine-margin", "1.01", "--budget-min", "30", timeout=480,
                 env_extra={"TP_OVERLAP_TUNE_FAKE_STEP_MS": json.dumps(FAKE_STEP_MS),
                            "TP_OVERLAP_TUNE_FAIL": json.dumps(FAIL)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cache, proc


@pytest.mark.timeout(600)  # with the module's tune run
def test_tune_prints_its_estimate_first_and_writes_the_tables(tuned):
    cache, proc = tuned
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
    # the rows failed on purpose: one line each as it happened, the list at the end, and the exit code 0
    assert "all_reduce/norm/128x1 failed its check and runs stock" in proc.stderr, proc.stderr[-3000:]
    assert "a rank died measuring fused_ops/rs/4x64x128" in proc.stderr, proc.stderr[-3000:]
    assert "2 rows failed and run stock" in proc.stderr, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("tp-overlap tune: demo at TP=2 on cpu (quick)") and "estimated" in first, first
    table = json.loads((cache / "dispatch" / "cpu-tp2.json").read_text())
    assert table["models"] == ["demo"] and table["world"] == 2 and table["margin"] == 0
    assert [(f["phase"], f["key"]) for f in table["failed"]] == [("all_reduce", "norm/128x1"),
                                                                 ("fused_ops", "rs/4x64x128")], table["failed"]
    assert "failed on purpose" in table["failed"][0]["why"] and "a rank died" in table["failed"][1]["why"]
    # no row without a time: the all-reduce section holds the measured message sizes alone
    assert [r["bytes"] for r in table["all_reduce"]] == [8192], table["all_reduce"]
    assert all(r["ours_graph_us"] is not None or r["ours_eager_us"] is not None for r in table["all_reduce"])
    assert {k: table[k] for k in tables.VERSION_KEYS} == tables.versions("cpu")
    # every local matmul of the demo model at TP=2 has its GEMV rows and (column/row layers) fused rows
    d = Dispatcher.load("table", "cpu", 2, path=cache / "dispatch" / "cpu-tp2.json")
    layers = [("qkv", 128, 128), ("o_proj", 64, 128), ("gate_up", 128, 256), ("down", 128, 128), ("lm_head", 128, 160)]
    assert d.missing_shapes(layers, 2) == [] and d.gemv(1, 64, 128) and d.fused_gemm("ag", 4, 128, 256)
    assert d.missing_shapes([("qkv", 4096, 3072)], 2) == [("qkv", 4096, 3072)]
    gemm = json.loads((cache / "gemm" / "cpu.json").read_text())
    assert {(e["M"], e["K"], e["N"]) for e in gemm["entries"]} == {(16, 64, 128), (16, 128, 128), (16, 128, 256)}
    # the decode matmul's configs (both paths at 4 rows on the CPU) and the fused gate_up + SiLU-mul rows
    decode = json.loads((cache / "decode" / "cpu.json").read_text())
    assert {(e["M"], e["K"], e["N"]) for e in decode["entries"]} == {(4, 64, 128), (4, 128, 128), (4, 128, 160),
                                                                      (4, 128, 256)}
    # gate_up fused in the decode matmul at one row, against the faster of cuBLAS and our GEMV, then the kernel
    assert [(r["M"], r["K"], r["N"], r["winner"]) for r in table["gemm_silu_mul"]] == [(1, 128, 256, "fused")]
    evidence = (cache / "evidence" / "cpu-tp2.md").read_text()
    assert "Regenerate: `tp-overlap tune --tp 2 --model demo`" in evidence and "# GEMM core configs" in evidence
    assert "# Decode matmul configs" in evidence and "## gate_up + SiLU-mul" in evidence
    # the engine's verdict: the chunked design chosen (it won 8 tokens); the 16-token step lost in every
    # layout: stock there; one token is not sharded in either design: the replicated layout
    assert table["engine_margin"] == 1.01 and table["fused_ops"] == "chunked" and d.fused_ops == "chunked"
    assert all(r["key"].endswith("@chunked") for r in table["gemm"]), table["gemm"]
    assert [(r["kind"], r["M"], r["layout"], r["runs"], r.get("design"), "kernel" in r, "chunked" in r)
            for r in table["engine"]] == [
        ("decode", 1, "replicated", "replicated", None, False, False),
        ("prefill", 8, "sharded", "flag", "chunked", False, True),
        ("prefill", 16, "sharded", "stock", None, False, True)]
    # (the one-launch design lost its GEMM-RS row to the crash: it has no sharded layout, so no sharded round)
    assert [d.step_runs(m, DEMO_OPS) for m in (1, 3, 8, 9, 16, 64)] == ["replicated", "replicated", "flag", "stock",
                                                                       "stock", "stock"]
    assert d.step_runs(16, DEMO_OPS[2:]) == "stock"   # vLLM's question: its row layers' ops only
    assert "## The engine's verdict" in evidence and "# This run: wall time per phase" in evidence
    # CPU rows are a smoke run, not CUDA-graph timings of a GPU; no heading without rows under it
    assert "CUDA graph" not in evidence and "one GPU" not in evidence and "0/0 shapes" not in evidence
    # no heading without rows under it: a heading's next line is text, or a heading of a deeper level
    for heading, level, nxt in re.findall(r"^((#+) .*)\n+(?=(#+ |\S|\Z))", evidence, re.MULTILINE):
        assert nxt and not (nxt.startswith("#") and len(nxt) - 1 <= len(level)), (heading, evidence)
    # a second run resumes: nothing is measured again
    again = _tune(cache, "--tp", "2", "--quick", "--device", "cpu", "--model", "demo", "--margin", "0",
                  "--engine-margin", "1.01")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "every row is measured already" in again.stderr, again.stderr[-3000:]
    again_table = json.loads((cache / "dispatch" / "cpu-tp2.json").read_text())
    assert again_table["gemv"] == table["gemv"] and again_table["engine"] == table["engine"]


def test_a_server_with_the_flag_uses_the_cached_tables(tuned):
    from serving_helpers import ServerProcess

    cache, _ = tuned
    args = ["--tp", "2", "--dtype", "float16", "--max-model-len", "64", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "16", "--no-access-log", "--tp-overlap"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "TP_OVERLAP_CACHE": str(cache)}
    with ServerProcess(args, env=env, start_timeout=240) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=240) as c:
            # 8 prompt tokens: the step size whose sharded chunked step won; then 1-row decode steps
            c.completions.create(model="demo", prompt="Hi ther", max_tokens=2, temperature=0)
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
            # 16 prompt tokens: a step size whose engine check lost, served stock
            c.completions.create(model="demo", prompt="Hi there, again", max_tokens=1, temperature=0)
        after = httpx.get(srv.url + "/metrics", timeout=30).text
        log = srv.log_tail(400)
    assert f"cache table {cache / 'dispatch' / 'cpu-tp2.json'}" in log, log
    assert "no dispatch table" not in log and "no rows for this model" not in log, log
    calls, calls_after = _op_calls(metrics), _op_calls(after)
    # prefill (M >= 4 tokens): the sharded layout's fused ops, of the design the verdict chose (chunked);
    # decode (1 row): our GEMV
    assert calls.get("chunked_ag.kernel", 0) > 0 and calls.get("chunked_rs.kernel", 0) > 0, calls
    assert "ag_gemm.kernel" not in calls, calls
    assert calls.get("gemv.kernel", 0) > 0, calls
    # the 16-token step: none of our kernels, counted as served stock by the verdict
    assert {k: v for k, v in calls_after.items() if k.endswith(".kernel")} == \
        {k: v for k, v in calls.items() if k.endswith(".kernel")}, (calls, calls_after)
    assert calls_after["layers.stock_steps_by_verdict"] > calls.get("layers.stock_steps_by_verdict", 0)


def _op_calls(metrics: str) -> dict:
    return {line.split('path="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith("tp_overlap_tp_op_calls_total{")}


def _table(device="cpu", world=2, **over):
    t = {"device": device, "world": world, "date": "2026-11-24", **tables.versions("cpu"), "margin": 1.02,
         "gemm": [], "all_reduce": [{"bytes": 8192, "graph_winner": "ipc", "eager_winner": "ipc"}]}
    t.update(over)
    return t


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_OVERLAP_CACHE", str(tmp_path))
    return tmp_path


def _put(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_lookup_order_explicit_then_cache_then_shipped_then_none(cache, tmp_path):
    explicit = _put(tmp_path / "mine.json", json.dumps(_table(all_reduce=[])))
    _put(cache / "dispatch" / "cpu-tp2.json", json.dumps(_table()))
    d = Dispatcher.load("table", "cpu", 2, path=explicit)
    assert d.source.startswith(f"explicit table {explicit}") and not d.ipc_all_reduce(8192, True)
    d = Dispatcher.load("table", "cpu", 2)
    assert d.source.startswith("cache table") and d.ipc_all_reduce(8192, True) and d.warnings == []
    # H200 at TP=2: the shipped table unless the cache holds one
    assert Dispatcher.load("table", "NVIDIA H200", 2).source.startswith("shipped table")
    _put(cache / "dispatch" / "h200-tp2.json", json.dumps(_table("NVIDIA H200")))
    assert Dispatcher.load("table", "NVIDIA H200", 2).source.startswith("cache table")
    none = Dispatcher.load("table", "cpu", 4)
    assert none.missing and not none.may_use_kernels
    assert "`tp-overlap tune --tp 4 --model MODEL`" in none.startup_warnings("cpu", 4)[0]


def test_corrupt_stale_and_other_device_tables_warn_and_never_fail(cache):
    bad = _put(cache / "dispatch" / "h200-tp2.json", '{"device": "NVIDIA H200", "gem')
    d = Dispatcher.load("table", "NVIDIA H200", 2, model="llama-3-8b")
    assert d.source.startswith("shipped table"), d.source       # fell back past the corrupt one
    (w,) = d.warnings
    assert str(bad) in w and "not a readable JSON table" in w and "`tp-overlap tune --tp 2 --model llama-3-8b`" in w

    _put(bad, json.dumps(_table("NVIDIA H200", torch="2.0.0", driver="cuda 11.8")))
    d = Dispatcher.load("table", "NVIDIA H200", 2)
    assert d.source.startswith("cache table")
    (w,) = d.warnings
    assert "may be stale" in w and "torch 2.0.0" in w and "tp-overlap tune --tp 2" in w

    bad.unlink()  # no cache: the shipped H200 table on an H200 NVL (same chip, another device)
    d = Dispatcher.load("table", "NVIDIA H200 NVL", 2)
    (w,) = d.warnings
    assert d.source.startswith("shipped table") and "measured on NVIDIA H200, on a different device" in w

    # no shipped table behind a corrupt cached one: the second warning says so, not that the cache lacks it
    _put(cache / "dispatch" / "cpu-tp2.json", "{")
    skipped, none = Dispatcher.load("table", "cpu", 2).startup_warnings("cpu", 2)
    assert "not a readable JSON table" in skipped and "no cpu-tp2.json in the cache" not in none
    assert f"the cached {cache / 'dispatch' / 'cpu-tp2.json'} does not read, and none is shipped" in none
    # one that reads but whose rows are not rows is skipped the same way (tables.load, the one loader)
    _put(cache / "dispatch" / "cpu-tp2.json", json.dumps(_table(gemv="oops")))
    d = Dispatcher.load("table", "cpu", 2)
    (w,) = d.warnings
    assert d.missing and "does not parse" in w and "'gemv' must be a list of rows" in w, w

    # the GEMM config table likewise: a corrupt cached one falls back to the shipped one
    from tp_overlap_plugin import gemm_config
    _put(cache / "gemm" / "h200.json", "[]")
    gemm_config.find_table.cache_clear()
    try:
        table, found = gemm_config.find_table("NVIDIA H200")
    finally:
        gemm_config.find_table.cache_clear()
    assert table is not None and found.origin == "shipped" and "is not a table" in found.warnings[0]


def test_one_bucketed_table_type_serves_the_config_tables(monkeypatch):
    import torch

    from tp_overlap_plugin import decode_config, gemm_config
    fma, mma = decode_config.DecodeConfig("fma", 16, 256), decode_config.DecodeConfig("mma", 64, 128, tma=True)
    data = {"buckets": [4, 64], "configs": {fma.label(): fma.to_dict(), mma.label(): mma.to_dict()},
            "entries": [{"M": 64, "N": 128, "K": 256, "label": fma.label()}],
            "defaults": {"4": fma.label(), "64": mma.label()}}
    t = tables.BucketedTable.parse(data, decode_config.DecodeConfig.from_dict)
    assert (t.bucket(3), t.bucket(5), t.bucket(1000)) == (4, 64, 64)
    assert (t.config(2, 1, 1), t.config(33, 1, 1), t.config(33, 128, 256)) == (fma, mma, fma)
    # the decode matmul takes a bucket's config only where its path takes the rows (FMA: up to 16)
    monkeypatch.setattr(decode_config, "load_table", lambda name: t)
    monkeypatch.setattr(gemm_config, "_device_name", lambda device: "Test GPU")
    cuda = torch.device("cuda")
    assert decode_config.pick_decode_config(12, 128, 256, cuda) == fma
    assert decode_config.pick_decode_config(33, 128, 256, cuda) in (decode_config.HOPPER_MMA, decode_config.CDNA3_MMA)
    assert issubclass(gemm_config.GemmTable, tables.BucketedTable)   # the same type, with the cuBLAS crossover


def test_the_engine_names_the_model_shapes_the_table_lacks(cache, caplog):
    from tp_overlap_plugin.serving import LLM, EngineConfig

    # a table for cpu at TP=2 that measured another model: the demo's layers are named, the start succeeds
    _put(cache / "dispatch" / "cpu-tp2.json",
         json.dumps(_table(gemv=[{"M": 1, "K": 4096, "N": 3072, "winner": "stock"}], all_reduce=[])))
    caplog.set_level(logging.INFO, logger="tp_overlap_plugin.serving.worker.layer_factory")
    with LLM(EngineConfig(tensor_parallel_size=2, tp_overlap=True, max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=16, num_kv_blocks=16, show_progress=False, dist_timeout_s=60)) as llm:
        assert llm.generate("Hi", {"max_tokens": 1, "temperature": 0})[0].outputs[0].token_ids
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "tp_overlap_plugin.serving.worker.layer_factory"]
    assert len(warnings) == 1, warnings
    assert "no rows for this model's qkv K=128 N=128, o_proj K=64 N=128" in warnings[0]
    assert "`tp-overlap tune --tp 2 --model demo`" in warnings[0]


def test_an_unwritable_cache_is_a_clear_error_before_measuring(tmp_path):
    keep = _put(tmp_path / "ro" / "dispatch" / "cpu-tp2.json", json.dumps(_table()))
    ro = tmp_path / "ro"
    os.chmod(ro, 0o555)
    try:
        target = ro if os.geteuid() != 0 else keep / "sub"  # root writes anywhere: a path under a file then
        proc = _tune(target, "--tp", "2", "--device", "cpu", "--model", "demo", timeout=60)
    finally:
        os.chmod(ro, 0o755)
    assert proc.returncode == 1
    assert f"tp-overlap tune: error: the tp-overlap cache {target} is not writable" in proc.stderr
    assert "TP_OVERLAP_CACHE" in proc.stderr
    assert "estimated" not in proc.stderr                      # nothing was started
    assert json.loads(keep.read_text()) == _table()           # and nothing lost


def test_only_measures_the_named_phases(tmp_path, capsys):
    """`tune --only PHASE` (what the retired bench/gemv.py, gemm_ar.py, ... ran): that phase's rows and
    no other's; the dispatch table is built (of them), the config tables' phases are not run; a phase
    that does not exist is a one-line usage error naming the phases, before any rank starts."""
    from tp_overlap_plugin.cli.main import main
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--tp", "1", "--device", "cpu", "--model", "demo", "--only", "gemv,bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "estimated" not in err
    assert "unknown phase(s) ['bogus']; the phases are gemm_configs, decode_configs, gemv," in err, err
    cache = tmp_path / "cache"
    proc = _tune(cache, "--tp", "1", "--quick", "--device", "cpu", "--model", "demo", "--only", "gemv",
                 "--margin", "0", "--budget-min", "30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " in 1 phases" in proc.stderr.splitlines()[0], proc.stderr[:500]
    assert sorted(p.name for p in (cache / "measurements").iterdir()) == ["cpu-tp1"]
    assert sorted(p.name for p in (cache / "measurements").rglob("*.json")) == ["gemv.json"]
    table = json.loads((cache / "dispatch" / "cpu-tp1.json").read_text())
    assert table["gemv"] and all(r["winner"] == "gemv" for r in table["gemv"])
    assert not table.get("gemm") and not table.get("gemm_silu_mul") and not table.get("engine")
    assert not (cache / "gemm" / "cpu.json").exists() and not (cache / "decode" / "cpu.json").exists()


def test_two_runs_at_once_leave_one_valid_file_with_both_runs_rows(tmp_path):
    """Two `tune` runs at once on one cache (TP=1: the single-GPU phases), of two models: the tables
    are valid JSON and hold both models' rows; no temporary file is left behind."""
    tiny = tmp_path / "tiny"
    _put(tiny / "config.json", json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}))
    cache = tmp_path / "cache"
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "TP_OVERLAP_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-m", "tp_overlap_plugin.cli", "tune", "--tp", "1", "--quick",
                               "--device", "cpu", "--model", model, "--budget-min", "30"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir()) for model in ("demo", str(tiny))]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    from tp_overlap_plugin.serving.model.demo import demo_hf_config
    from tp_overlap_plugin.shapes import ModelDims
    dims = [ModelDims.from_hf(demo_hf_config()), ModelDims.from_hf(json.loads((tiny / "config.json").read_text()))]
    layers = {(k, n) for d in dims for _, k, n in d.layers(1)}
    table = json.loads((cache / "dispatch" / "cpu-tp1.json").read_text())
    assert {(r["K"], r["N"]) for r in table["gemv"]} == layers | {d.lm_head(1)[1:] for d in dims}
    assert set(table["models"]) == {"demo", "tiny"}
    gemm = json.loads((cache / "gemm" / "cpu.json").read_text())
    assert {(e["K"], e["N"]) for e in gemm["entries"]} == layers
    decode = json.loads((cache / "decode" / "cpu.json").read_text())
    assert {(e["K"], e["N"]) for e in decode["entries"]} == layers | {d.lm_head(1)[1:] for d in dims}
    assert not [p for p in cache.rglob("*.tmp")]


def test_the_verdict_rule_and_its_lookup_per_step_size():
    """rules.step_verdict: the flag where it won by the margin in every repeat, else its ops replicated
    where those did (against their own round's stock times), else stock; Dispatcher.step_runs: the
    more cautious measured neighbour, rows of the model whose ops include the question's."""
    from tp_overlap_plugin.tuning.rules import choose_design, step_verdict

    stock, fast, tie = [1.1, 1.1, 1.1], [1.0, 1.0, 1.0], [1.0, 1.0, 1.09]
    won = {"kernel_stock_ms_repeats": stock, "kernel_ms_repeats": fast}
    assert step_verdict(won, 1.05, "kernel") == "flag"
    assert step_verdict(won, 1.05, "chunked") == "stock"  # an engine of the other design: not measured sharded
    assert step_verdict({"kernel_stock_ms_repeats": stock, "kernel_ms_repeats": tie}, 1.05) == "stock"  # one short
    lost = {"kernel_stock_ms_repeats": stock, "kernel_ms_repeats": tie}
    assert step_verdict({**lost, "replicated_stock_ms_repeats": stock, "replicated_ms_repeats": fast}, 1.05) == \
        "replicated"
    assert step_verdict({**lost, "replicated_stock_ms_repeats": fast, "replicated_ms_repeats": fast}, 1.05) == "stock"
    # the design: the most step sizes won, then the larger summed ratio; none measured: the first
    both = {"a": {**won, "chunked_stock_ms_repeats": stock, "chunked_ms_repeats": [0.9] * 3},
            "b": {**lost, "chunked_stock_ms_repeats": stock, "chunked_ms_repeats": fast}}
    assert choose_design(both, 1.05) == "chunked"
    assert choose_design({"a": won}, 1.05) == "kernel" and choose_design({}, 1.05, ("chunked", "kernel")) == "chunked"

    mine = [["ag", 16, 8], ["rs", 8, 16]]
    rows = [{"M": 1, "shapes": mine, "runs": "flag"}, {"M": 64, "shapes": mine, "runs": "replicated"},
            {"M": 2048, "shapes": mine, "runs": "stock"}, {"M": 64, "shapes": [["rs", 4, 4]], "runs": "stock"}]
    d = Dispatcher(engine_rows=rows)
    ops = (("ag", 16, 8), ("rs", 8, 16))
    assert [d.step_runs(m, ops) for m in (1, 2, 64, 100, 2048, 9000)] == [
        "flag", "replicated", "replicated", "stock", "stock", "stock"]
    assert d.step_runs(1, (("rs", 8, 16),)) == "flag" and d.step_runs(3, (("rs", 4, 4),)) == "stock"
    assert d.step_runs(2048, (("ag", 1, 1),)) == "flag"            # a model never checked: the per-op rows
    assert Dispatcher(mode="overlap", engine_rows=rows).step_runs(2048, ops) == "flag"


def test_the_gemm_all_reduce_rule_ignores_the_removed_fused_norm_measurements():
    """GEMM + all-reduce (alone, and + the norm) is chosen where it beat the faster stock path by the
    margin in every repeat, in graphs only (eager rows are launch-bound noise: rules.gemm_all_reduce_rows).
    Stores from before GEMM + all-reduce + norm as one kernel was removed hold its measurements
    (gemm_ar_fused_norm, here faster than everything): they make no column and decide nothing."""
    from tp_overlap_plugin.tuning import rules

    def row(m, gemm_ar, gemm_ar_norm, last_repeat=None):
        times = {"linear_nccl": 20, "linear_ours": 15, "gemm_ar": gemm_ar, "linear_nccl_norm": 25,
                 "linear_fused_norm": 16, "gemm_ar_norm": gemm_ar_norm, "gemm_ar_fused_norm": 5, "gemv_fused_norm": 4}
        r = {"M": m, "K": 1024, "N": 4096, "shape": "llama o_proj"}
        for mode in ("graph", "eager"):
            r.update({f"{op}_{mode}_us": t for op, t in times.items()})
            r.update({f"{op}_{mode}_us_repeats": [t, t] for op, t in times.items()})
        if last_repeat is not None:
            r["gemm_ar_graph_us_repeats"] = [gemm_ar, last_repeat]
        return r
    # 16 rows: 15 / 14.9 is under the margin; 64 rows: one repeat under it
    measured = {"1": row(1, 12, 14), "16": row(16, 14.9, 14), "64": row(64, 12, 17, last_repeat=15 / 1.01)}
    rows = rules.gemm_all_reduce_rows(measured)
    got = {r["M"]: (r["graph_winner"], r["norm_graph_winner"], r["eager_winner"], r["norm_eager_winner"],
                    r["graph_best_stock_us"], r["norm_graph_best_stock_us"]) for r in rows}
    assert got == {1: ("gemm_ar", "gemm_ar", "stock", "stock", 15, 16),
                   16: ("stock", "gemm_ar", "stock", "stock", 15, 16),
                   64: ("stock", "stock", "stock", "stock", 15, 16)}, got
    assert not any("fused" in k for r in rows for k in r), rows
    # (the table runs the fused all-reduce + norm at this hidden size: the "+norm" columns decide)
    d = Dispatcher(gemm_all_reduce_rows=rows,
                   norm_rows=[{"hidden": 4096, "tokens": 1, "graph_winner": "fused", "eager_winner": "fused"}])
    assert [d.gemm_all_reduce(m, 1024, 4096, True) for m in (1, 8, 16)] == [True, False, False]
    assert [d.gemm_all_reduce(m, 1024, 4096, True, into_norm=True) for m in (1, 16, 17)] == [True, True, False]


def test_the_table_holds_one_fused_op_design_and_an_engine_of_the_other_leaves_its_rows_out():
    """The chunked design's rows (keyed apart) are compared in CUDA graphs, where the engine runs them;
    the one-launch design's eagerly; a table says which design it measured, and an engine that runs
    the other one drops those rows and the verdict (replicated layout) with a warning naming the
    command that measures its design, keeping the rest of the table."""
    from tp_overlap_plugin.shapes import ModelDims
    from tp_overlap_plugin.serving.config import EngineConfig
    from tp_overlap_plugin.tuning import rules
    from tp_overlap_plugin.tuning.plan import make_plan

    shape = {"op": "ag", "M": 8192, "K": 4096, "N": 1536}
    measured = {  # eager: the one-launch op wins, the chunked loses; in graphs the chunked wins
        "ag/8192x4096x1536": {**shape, "design": "kernel", "sequential": 0.34, "ours": 0.29,
                              "sequential_graph": 0.33, "ours_graph": 0.27},
        "ag/8192x4096x1536@chunked": {**shape, "design": "chunked", "sequential": 0.34, "ours": 0.41,
                                      "sequential_graph": 0.33, "ours_graph": 0.26},
    }
    env = {"device": "X", "tp": 4, "date": "2026-11-27", "torch": "t", "triton": "3"}
    kernel = rules.build({"fused_ops": measured}, env, command="c")
    chunked = rules.build({"fused_ops": measured}, env, command="c", fused_ops="chunked")
    assert "fused_ops" not in kernel and chunked["fused_ops"] == "chunked"  # no field: the one-launch design
    assert [(r["key"], r["ours_ms"], r["winner"]) for r in kernel["gemm"]] == [("ag/8192x4096x1536", 0.29, "overlap")]
    assert [(r["key"], r["ours_ms"], r["winner"]) for r in chunked["gemm"]] == [
        ("ag/8192x4096x1536@chunked", 0.26, "overlap")]
    # an eager-only chunked row has no graph columns: no row, not an eager verdict
    eager_only = {"k": {**shape, "design": "chunked", "sequential": 0.34, "ours": 0.30}}
    assert rules.gemm_rows(eager_only, design="chunked") == []

    plan = make_plan("demo", ModelDims.of(EngineConfig(model="demo").load_model_config()), 2, "cpu", True, 1.02,
                     1.02, fused_ops="chunked")
    assert plan.fused_ops == "chunked" and all(it["key"].endswith("@chunked") for it in plan.items["fused_ops"])

    table = Dispatcher(gemm=kernel["gemm"], all_reduce=[{"bytes": 1, "graph_winner": "ipc", "eager_winner": "ipc"}],
                       engine_rows=[{"M": 8192, "shapes": [], "runs": "flag"}], fused_ops="kernel")
    assert table.for_design("kernel") is table
    other = table.for_design("chunked")
    assert other.gemm == [] and other.engine_rows == [] and other.all_reduce == table.all_reduce
    assert other.fused_ops == "chunked" and "--fused-ops chunked" in other.warnings[-1]
    assert not other.fused_gemm("ag", 8192, 4096, 1536) and table.fused_gemm("ag", 8192, 4096, 1536)


def test_the_fused_ops_are_measured_at_the_engines_own_prefill_steps():
    """A step between two measured sizes runs as the more cautious of them, so the sizes the engine's
    prefill steps take (its budget, and the shorter step the verdict checks) are measured themselves."""
    from tp_overlap_plugin.shapes import ModelDims
    from tp_overlap_plugin.serving.config import EngineConfig
    from tp_overlap_plugin.tuning import engine_check
    from tp_overlap_plugin.tuning.plan import make_plan

    dims = ModelDims.of(EngineConfig(model="llama-3-8b").load_model_config())
    for world, budget in ((4, None), (2, 6000), (8, None)):
        plan = make_plan("llama-3-8b", dims, world, "cuda", False, 1.02, 1.02, step_budget=budget)
        steps = {it["tokens"] for it in plan.items["engine"] if it["kind"] == "prefill"}
        assert steps == {budget or engine_check.DEFAULT_BUDGET, engine_check.PREFILL_TOKENS}
        for layer, _, _ in dims.layers(world):
            for design in plan.designs:
                ms = {it["M"] for it in plan.items["fused_ops"] if it["layer"] == layer and it["design"] == design}
                assert steps <= ms and {1024, 4096, 16384} <= ms, (world, layer, design, sorted(ms))
        # the engine's sizes of every design and layer come first (a run cut short keeps them)
        first = len(steps) * len(plan.designs) * len(dims.layers(world))
        assert all(it["M"] in steps for it in plan.items["fused_ops"][:first])
        assert not any(it["M"] in steps for it in plan.items["fused_ops"][first:])
        # gate_up fused at the GEMV's rows that have FMA candidates (1-8), then at the GEMM's sizes
        assert [it["M"] for it in plan.items["silu_mul"]] == [1, 2, 4, 8, 16, 64, 256, 1024, 2048, 4096, 8192]


def test_a_table_of_several_models_names_a_run_for_each():
    """The dispatch table holds every model tuned into the cache at its TP size (h200-tp4: 8B, then
    70B): its command measures each again, the run that wrote it last."""
    from types import SimpleNamespace

    from tp_overlap_plugin.tuning.report import _dispatch_command
    plan = SimpleNamespace(model="llama-3-70b", fused_ops="auto")
    assert _dispatch_command(4, plan, ["llama-3-70b", "llama-3-8b"]) == (
        "tp-overlap tune --tp 4 --model llama-3-8b && tp-overlap tune --tp 4 --model llama-3-70b")
    assert _dispatch_command(2, plan, []) == "tp-overlap tune --tp 2 --model llama-3-70b"


@pytest.mark.parametrize("est_ms", [0.01, 0.9, 2.8, 19.4, 29.0, 67.0, 110.0, 520.0, 5000.0])
def test_the_verdicts_repeat_is_whole_turns_of_both_orders(est_ms):
    """A repeat: about TARGET_S of steps (2..MAX_CALLS), in turns of about TURN_S (a step at least),
    a whole number of them and at least two, so that each engine runs first in one."""
    from tp_overlap_plugin.tuning import engine_check as ec
    calls, per_turn = ec._turns(est_ms)
    assert 2 <= calls <= ec.MAX_CALLS and calls % per_turn == 0 and calls // per_turn >= 2
    if 1e3 * ec.TARGET_S / est_ms <= ec.MAX_CALLS:      # not capped: the repeat runs about TARGET_S
        assert calls * est_ms >= min(1e3 * ec.TARGET_S, 2 * est_ms) * 0.9
    if est_ms >= 1e3 * ec.TURN_S:                         # a long step: a turn of one step
        assert per_turn == 1
    else:                                                 # short steps: a turn of about TURN_S, launched back to back
        assert per_turn * est_ms >= 1e3 * ec.TURN_S * 0.5 or per_turn == calls // 2
