"""`--model org/name` loads through huggingface_hub: offline (HF_HUB_OFFLINE=1) against a Hub cache the
test builds itself (models--org--name/snapshots/<rev>/ + refs/main, as `hf download` leaves it) holding
the demo model as a checkpoint; the engine serves the same tokens as the built-in demo, and an id that is
not in the cache is a one-line error that says so.

One fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported."""

import json
import os
import subprocess
import sys

import pytest

REPO = "tiny-org/demo-llama"
REV = "0123456789abcdef0123456789abcdef01234567"

SCRIPT = r"""
import json, pathlib, sys, time
from safetensors.torch import save_file
from tp_overlap_plugin.serving import LLM, EngineConfig, SamplingParams
from tp_overlap_plugin.cli.main import main
from tp_overlap_plugin.serving.config import resolve_model_dir
from tp_overlap_plugin.serving.model.demo import demo_hf_config, demo_state_dict

repo, rev, hub = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
prompts = [[5, 17, 42, 99], [3, 1, 4, 1, 5, 9, 2, 6]]
out = {}
with LLM(EngineConfig(model="demo", max_model_len=64, show_progress=False)) as llm:
    out["demo"] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    params = llm.engine.runner.model.checkpoint_params()
    state = demo_state_dict([(name, p[3]) for name, p in params.items()])

# The Hub cache's layout: the snapshot of a commit, and the branch pointing at it.
repo_dir = hub / ("models--" + repo.replace("/", "--"))
snapshot = repo_dir / "snapshots" / rev
snapshot.mkdir(parents=True)
(snapshot / "config.json").write_text(json.dumps(demo_hf_config()))
save_file(state, str(snapshot / "model.safetensors"))
(repo_dir / "refs").mkdir()
(repo_dir / "refs" / "main").write_text(rev)

out["resolved"] = str(resolve_model_dir(repo))
with LLM(EngineConfig(model=repo, max_model_len=64, show_progress=False)) as llm:
    out["hub"] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
try:
    resolve_model_dir("tiny-org/not-cached")
except FileNotFoundError as e:
    out["missing"] = str(e)
out["cli_rc"] = main(["generate", "--model", "tiny-org/not-cached", "--max-tokens", "2"])
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_hub_id_loads_from_the_cache_offline(tmp_path):
    hub = tmp_path / "hf" / "hub"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, REPO, REV, str(hub)], env=env, capture_output=True,
                          text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["resolved"] == str(hub / "models--tiny-org--demo-llama" / "snapshots" / REV)
    assert out["hub"] == out["demo"] and all(len(t) == 6 for t in out["hub"])
    assert "tiny-org/not-cached" in out["missing"] and "HF_HUB_OFFLINE is set" in out["missing"]
    assert str(hub) in out["missing"]
    # the command line: one line and the hint, no traceback
    assert out["cli_rc"] == 2 and "Traceback" not in proc.stderr  # a --model that names nothing: a bad command line
    error = next(line for line in proc.stderr.splitlines() if line.startswith("tp-overlap generate: error:"))
    assert "not in the Hugging Face cache" in error and "hf download tiny-org/not-cached" in error
