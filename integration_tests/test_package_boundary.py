"""The plugin (what vLLM loads) never imports the engine, and the `tp-overlap` entry imports no Triton
before it has decided on TRITON_INTERPRET. Each check runs in a fresh interpreter: this test process
has imported everything already."""

import json
import subprocess
import sys

PLUGIN_MODULES = ["tp_overlap_plugin", "tp_overlap_plugin.vllm_plugin", "tp_overlap_plugin.heap",
                  "tp_overlap_plugin.heap_shm", "tp_overlap_plugin.heap_ipc", "tp_overlap_plugin.heap_torch",
                  "tp_overlap_plugin.error_slot", "tp_overlap_plugin.options",
                  "tp_overlap_plugin.ops.gemm", "tp_overlap_plugin.ops.gemv", "tp_overlap_plugin.ops.ag_gemm",
                  "tp_overlap_plugin.ops.gemm_rs", "tp_overlap_plugin.ops.gemm_ar", "tp_overlap_plugin.ops.all_reduce",
                  "tp_overlap_plugin.ops.all_reduce_norm", "tp_overlap_plugin.layers",
                  "tp_overlap_plugin.overlap_layers", "tp_overlap_plugin.dispatch", "tp_overlap_plugin.custom_ops",
                  "tp_overlap_plugin.multirank", "tp_overlap_plugin.runtime", "tp_overlap_plugin.tables",
                  "tp_overlap_plugin.shapes"]


def _loaded_after(code: str) -> list[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_plugin_never_imports_the_engine():
    loaded = _loaded_after("\n".join(f"import {m}" for m in PLUGIN_MODULES))
    assert set(PLUGIN_MODULES) <= set(loaded)
    assert not [m for m in loaded if m.startswith("tp_overlap_plugin.serving")]


def test_the_command_imports_no_triton_before_it_runs():
    loaded = _loaded_after("import tp_overlap_plugin.cli.main")
    assert "triton" not in loaded and "tp_overlap_plugin.serving.engine" not in loaded


def test_the_engine_names_still_import_from_the_package():
    loaded = _loaded_after("from tp_overlap_plugin.serving import LLM, AsyncLLM, EngineConfig, SamplingParams")
    assert "tp_overlap_plugin.serving.engine" in loaded
