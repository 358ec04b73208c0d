"""`tp-overlap tune --shapes shipped`: the one command that regenerates a shipped per-device config table
(gemm_tables/<device>.json, decode_tables/<device>.json). It plans the GEMM core's and the decode matmul's
phases on the linear shapes of every model config shipped with the engine, at each of TP = 1, 2, 4, 8
that divides it, measured on one GPU each (a shard's shape does not need its TP world), and the tables
it writes name it.

The plan is checked against the real shipped configs without measuring it (308 + 385 rows: half an
hour on an H200). The run is checked on the CPU under the Triton interpreter with the shipped configs'
folder pointed at two tiny configs (a real shipped shape takes ~30 s a row there): the tables, their
command, the shapes' names, a run cut by its budget saying what it left, and the options that do not
apply refused before anything starts."""

from __future__ import annotations

import json

import pytest

from test_bench_scripts import assert_gemm_table_reproducible
from tp_overlap_plugin import tables
from tp_overlap_plugin.tuning import shapes
from tp_overlap_plugin.tuning.plan import shipped_plan

COMMAND = "tp-overlap tune --tp 1 --shapes shipped"


def _expected(models: dict, lm_head: bool) -> dict:
    """{(K, N): {"<model> tp<W> <layer>", ...}} of every model at every TP size of shapes.SHIPPED_TPS that
    divides its heads and MLP width, written out here from the dims (not by the planner's helper)."""
    out: dict = {}
    for name, dims in models.items():
        for tp in shapes.SHIPPED_TPS:
            if dims.num_heads % tp or dims.num_kv_heads % tp or dims.intermediate % tp:
                continue
            for layer, k, n in dims.layers(tp) + ([dims.lm_head(tp)] if lm_head else []):
                out.setdefault((k, n), set()).add(f"{name} tp{tp} {layer}")
    return out


def _shapes_of(items: list) -> dict:
    out: dict = {}
    for it in items:
        out.setdefault((it["K"], it["N"]), set()).update(it["names"])
    return out


def test_the_plan_holds_every_shipped_models_shapes_at_tp_1_2_4_8():
    from tp_overlap_plugin.tuning import gemm_configs, gemv
    names = shapes.shipped_names()
    assert names == ["llama-3-70b", "llama-3-8b", "qwen2.5-7b"]   # the demo model is made in code: not one
    models = {n: shapes.shipped_dims(n) for n in names}
    plan = shipped_plan(1, "cuda", False, 1.02, 1.01)
    assert set(plan.items) == {"gemm_configs", "decode_configs"} and plan.dims is None
    gemm, decode = _shapes_of(plan.items["gemm_configs"]), _shapes_of(plan.items["decode_configs"])
    assert gemm == _expected(models, lm_head=False) and decode == _expected(models, lm_head=True)
    for name in ("llama-3-8b", "llama-3-70b"):
        assert {f"{name} tp{tp} down" for tp in (1, 2, 4, 8)} <= set().union(*gemm.values())
    # Qwen2.5-7B's 28 heads: no TP=8 (it cannot run there)
    assert not any(n.startswith("qwen2.5-7b tp8") for ns in decode.values() for n in ns)
    assert {"qwen2.5-7b tp4 lm_head", "qwen2.5-7b tp1 qkv"} <= set().union(*decode.values())
    # every shape at every M pass / decode row count, each once
    for phase, ms, got in (("gemm_configs", gemm_configs.M_PASSES, gemm),
                           ("decode_configs", gemv.decode_rows(), decode)):
        keys = [it["key"] for it in plan.items[phase]]
        assert len(keys) == len(set(keys)) == len(ms) * len(got)
        assert {(it["M"], it["K"], it["N"]) for it in plan.items[phase]} == {(m, k, n) for m in ms for k, n in got}
    # the shipped H200 tables are this plan's run (2026-11-28): every planned row, and no other
    for kind, phase in (("decode", "decode_configs"), ("gemm", "gemm_configs")):
        table = tables.read(kind, path=tables.shipped_path(kind, "NVIDIA H200"))
        shipped = {(e["M"], e["K"], e["N"]) for e in table["entries"]}
        planned = {(it["M"], it["K"], it["N"]) for it in plan.items[phase]}
        assert shipped == planned, kind
    # shared out over the ranks: more GPUs, the same rows, a shorter estimate; the command names the ranks
    eight = shipped_plan(8, "cuda", False, 1.02, 1.01)
    assert eight.items == plan.items and eight.estimate_s() < plan.estimate_s()
    assert plan.command == COMMAND and eight.command == "tp-overlap tune --tp 8 --shapes shipped"
    # the interpreter: the same shapes, at one size each
    cpu = shipped_plan(1, "cpu", False, 1.02, 1.01)
    assert _shapes_of(cpu.items["decode_configs"]) == decode and {it["M"] for it in cpu.items["gemm_configs"]} == {16}


@pytest.mark.parametrize("argv, error", [
    (["--model", "llama-3-8b"], "--model does not apply"),
    (["--fused-ops", "chunked", "--margin", "1.1"], "--margin and --fused-ops do not apply"),
    (["--only", "gemm_configs,gemv"], "--only gemv measures one model at one TP size: use --model instead"),
])
def test_options_that_do_not_apply_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys, argv, error):
    from tp_overlap_plugin.cli.main import main
    monkeypatch.setenv("TP_OVERLAP_CACHE", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["tune", "--tp", "1", "--device", "cpu", "--shapes", "shipped", *argv]) == 2
    err = capsys.readouterr().err
    assert error in err and "estimated" not in err, err
    assert list(tmp_path.iterdir()) == []


# two tiny configs: "tiny-a" runs at TP 1 and 2 (2 heads), "tiny-b" at TP 1 only; their shapes coincide in
# places (one row per shape, naming every layer of it): 5 GEMM shapes, 5 decode-matmul shapes
TINY = {"tiny-a": {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
        "tiny-b": {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64}}


@pytest.mark.timeout(300)
def test_the_command_writes_both_config_tables_naming_it(tmp_path, monkeypatch, capsys):
    from tp_overlap_plugin.cli.main import main
    from tp_overlap_plugin.shapes import ModelDims
    configs, cache = tmp_path / "model_configs", tmp_path / "cache"
    for name, heads in TINY.items():
        (configs / name).mkdir(parents=True)
        (configs / name / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, **heads}))
    monkeypatch.setattr(shapes, "MODEL_CONFIGS", configs)
    monkeypatch.setenv("TP_OVERLAP_CACHE", str(cache))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    models = {n: ModelDims.from_hf(json.loads((configs / n / "config.json").read_text())) for n in TINY}
    gemm_shapes, decode_shapes = _expected(models, lm_head=False), _expected(models, lm_head=True)
    assert (len(gemm_shapes), len(decode_shapes)) == (5, 5)
    tune = ["tune", "--tp", "1", "--device", "cpu", "--shapes", "shipped"]

    # a budget spent before the first row: nothing measured, nothing written, and what was left said
    assert main([*tune, "--budget-min", "0"]) == 0
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("tp-overlap tune: the shapes of every shipped model (tiny-a, tiny-b) at TP=1,2,4,8"), first
    assert "10 rows in 2 phases" in first and "`--budget-min" in err, err
    assert "gemm_configs: 0 measured, 0 kept from before, of 5, in" in err and ", 5 left" in err, err
    assert "stopped early with 10 rows left" in err and "no table was written" in err, err
    assert not (cache / "gemm").exists() and not (cache / "decode").exists()

    assert main([*tune, "--budget-min", "30"]) == 0
    err = capsys.readouterr().err
    assert "gemm_configs: 5 measured" in err and "decode_configs: 5 measured" in err and "left" not in err, err
    assert "copy them into the package's gemm_tables/ and decode_tables/" in err, err
    gemm, decode = (tables.read(kind, "cpu") for kind in ("gemm", "decode"))
    assert gemm["command"] == decode["command"] == COMMAND
    assert {(e["K"], e["N"]) for e in gemm["entries"]} == set(gemm_shapes)
    assert {(e["K"], e["N"]) for e in decode["entries"]} == set(decode_shapes)
    # the results the GEMM table is made of, as bench/results keeps a shipped table's
    assert gemm["source"].startswith("gemm-configs-tune-shipped-cpu-") and gemm["source"].endswith(".json")
    assert_gemm_table_reproducible(cache / "gemm" / "cpu.json", cache / "evidence")
    # the per-TP dispatch table is not this command's: none written
    assert not (cache / "dispatch").exists()
    evidence = (cache / "evidence" / "cpu-shipped.md").read_text()
    assert f"Regenerate: `{COMMAND}`" in evidence and "# GEMM core configs" in evidence, evidence
    assert "# Decode matmul configs" in evidence and "tiny-a tp2 qkv" in evidence and "tiny-b tp1 lm_head" in evidence
    assert "tiny-a tp4" not in evidence
    # a rerun has nothing left to measure: no rank starts, the tables stay
    assert main([*tune]) == 0
    assert "every row is measured already" in capsys.readouterr().err
    assert tables.read("gemm", "cpu")["entries"] == gemm["entries"]
