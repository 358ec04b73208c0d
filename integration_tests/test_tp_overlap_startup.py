"""The flag tells the truth at start-up: a device and TP size without a dispatch table, and a dtype
the fused kernels do not take, are each one warning in the log; on the CPU the kernels run under
the Triton interpreter, which the `tp-overlap` command turns on by itself, and a process that cannot
run them refuses to start (naming TRITON_INTERPRET=1) instead of failing its first request."""

import logging
import os
import subprocess
import sys
import tempfile

import pytest

from tp_overlap_plugin import tables
from tp_overlap_plugin.dispatch import Dispatcher

SMALL = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=16, show_progress=False,
             dist_timeout_s=60)


def test_table_names_follow_the_device():
    def table_path(device_name, world):
        return tables.shipped_path("dispatch", device_name, world)
    assert table_path("NVIDIA H200", 2).name == "h200-tp2.json"
    assert table_path("AMD Instinct MI300X", 8).name == "mi300x-tp8.json"
    assert table_path("AMD Instinct MI300X VF", 8).name == "mi300x-tp8.json"
    assert table_path("NVIDIA H100 80GB HBM3", 1).name == table_path("NVIDIA H100 PCIe", 1).name == "h100-tp1.json"
    assert Dispatcher.load("table", "NVIDIA H200", 2).missing is None


def test_no_table_is_a_warning_that_says_what_to_do():
    d = Dispatcher.load("table", "AMD Instinct MI300X", 8, model="llama-3-70b")
    msg = d.missing_table_warning("AMD Instinct MI300X", 8, "llama-3-70b")
    assert "mi300x-tp8.json" in msg and "stock path for every op" in msg
    assert "`tp-overlap tune --tp 8 --model llama-3-70b`" in msg and '"dispatch": "overlap"' in msg
    assert not d.may_use_kernels
    assert Dispatcher.load("overlap", "AMD Instinct MI300X", 8).missing_table_warning("x", 8) is None


def _startup_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "tp_overlap_plugin.serving.worker.layer_factory" and r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
def test_engine_warns_once_when_the_flag_has_no_table(caplog, monkeypatch):
    from tp_overlap_plugin.serving import LLM, EngineConfig

    monkeypatch.delenv("TP_OVERLAP", raising=False)
    caplog.set_level(logging.INFO, logger="tp_overlap_plugin.serving.worker.layer_factory")
    with LLM(EngineConfig(tensor_parallel_size=2, tp_overlap=True, **SMALL)) as llm:
        assert llm.generate("Hi", {"max_tokens": 2, "temperature": 0})[0].outputs[0].token_ids
    warnings = _startup_warnings(caplog)
    # float32 on the CPU, but with no table nothing would run the kernels: the table is the news
    assert len(warnings) == 1 and "no dispatch table for cpu at TP=2" in warnings[0], warnings


def test_engine_refuses_before_spawning_when_the_kernels_cannot_run(monkeypatch):
    import multiprocessing

    from tp_overlap_plugin import runtime
    from tp_overlap_plugin.serving import EngineConfig, LLMEngine

    monkeypatch.setattr(runtime, "use_triton_interpreter", lambda: False)
    cfg = EngineConfig(tensor_parallel_size=2, dtype="bfloat16", tp_overlap={"dispatch": "overlap"}, **SMALL)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LLMEngine(cfg)
    assert not multiprocessing.active_children()
    # at TP=1 the flag's layers run the decode matmul (no heap, no communication): the same check
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LLMEngine(EngineConfig(tensor_parallel_size=1, dtype="bfloat16", tp_overlap={"dispatch": "overlap"}, **SMALL))
    # stock at TP=1, or a flag whose table picks no kernel, has nothing to refuse
    LLMEngine(EngineConfig(tensor_parallel_size=1, dtype="bfloat16", tp_overlap={"dispatch": "stock"},
                           **SMALL)).shutdown()


@pytest.mark.timeout(60)
def test_a_heap_size_that_cannot_be_allocated_gets_advice_that_fits(monkeypatch):
    from tp_overlap_plugin.serving import EngineConfig, LLMEngine

    monkeypatch.delenv("TP_OVERLAP", raising=False)
    with pytest.raises(RuntimeError) as exc:     # 1 PiB per rank: no machine maps that
        LLMEngine(EngineConfig(tensor_parallel_size=2, tp_overlap={"heap_size": 1 << 50}, **SMALL))
    msg = str(exc.value)
    # The user set the size: the advice is to lower it (with what the model needs), not to set it.
    assert "tp_overlap.heap_size=1125899906842624; lower it" in msg and "MiB per rank" in msg, msg
    assert "set tp_overlap.heap_size" not in msg


def _cli(args, env_extra=None, timeout=150):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_OVERLAP")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tp_overlap_plugin.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tempfile.gettempdir())


ENGINE_ARGS = ["--tp", "2", "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
               "--num-kv-blocks", "16"]
OVERLAP = ["--tp-overlap-config", '{"dispatch": "overlap"}']


@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cli_runs_the_kernels_under_the_interpreter_by_itself(dtype):
    """No TRITON_INTERPRET in the environment, a CPU engine at TP=2 with the kernels forced: bf16
    runs them (interpreted: a compiled launch would fail for want of a GPU driver), float32 says
    at start-up that AG-GEMM and GEMM-RS fall back."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CLI turns the interpreter on by itself only on a machine without a GPU")
    proc = _cli(["generate", *ENGINE_ARGS, "--dtype", dtype, *OVERLAP, "--prompt", "Hi", "--max-tokens", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[2 tokens, finish: length]" in proc.stdout
    fallback = "AG-GEMM and GEMM-RS kernels take bfloat16 and float16 only"
    assert (fallback in proc.stderr) == (dtype == "float32"), proc.stderr[-3000:]
    assert proc.stderr.count(fallback) <= 1


@pytest.mark.timeout(120)
def test_cli_flag_at_tp1_runs_without_a_heap():
    """`--tp 1` with the flag (the decode matmul forced: no heap, no peers) generates what stock
    generates, greedily, in bf16 on the CPU (the matmuls interpreted)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CLI turns the interpreter on by itself only on a machine without a GPU")
    tp1 = ["--tp", "1", *ENGINE_ARGS[2:], "--dtype", "bfloat16", "--prompt", "Hi", "--max-tokens", "3"]
    outs = []
    for flag in ([], OVERLAP):
        proc = _cli(["generate", *tp1, *flag])
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.split("--- prompt:", 1)[1])
    assert "[3 tokens, finish: length]" in outs[0] and outs[0] == outs[1], outs


@pytest.mark.timeout(60)
def test_server_without_the_interpreter_refuses_to_start():
    proc = _cli(["serve", *ENGINE_ARGS, "--dtype", "bfloat16", *OVERLAP, "--port", "1"],
                env_extra={"TRITON_INTERPRET": "0"}, timeout=50)
    assert proc.returncode == 1, proc.stderr[-3000:]
    *_, error, hint = proc.stderr.strip().splitlines()
    assert error.startswith("tp-overlap serve: error: the engine did not start"), error
    assert "TRITON_INTERPRET=1" in error, error
    assert hint.strip() == "hint: --debug shows the traceback"
