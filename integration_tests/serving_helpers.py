"""Helpers for the tests: tiny random HF checkpoints, transformers reference outputs, and a server
in a subprocess (`ServerProcess`).

Tests import it as `serving_helpers`: pyproject.toml puts integration_tests/ on sys.path (pytest runs with
--import-mode=importlib, where test modules cannot import each other). `ServerProcess` itself lives in
the package (serving/entrypoints/server_process.py), where bench/ tools import it too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

# a server in a subprocess: in the package, shared with bench/ (serving/entrypoints/server_process.py)
from tp_overlap_plugin.serving.entrypoints.server_process import ServerProcess, free_port  # noqa: F401

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_hf_checkpoint(arch: str, path: Path, seed: int = 0, max_shard_size: Optional[str] = "40KB",
                       **overrides) -> Path:
    """Save a tiny random `arch` ("llama" | "qwen2" | "qwen3") model as safetensors under `path`."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "llama":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        kw.setdefault("tie_word_embeddings", False)
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        kw.setdefault("rope_theta", 1e6)
        cfg, cls = tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 32)   # Qwen3 decouples head_dim from hidden / heads
        kw.setdefault("tie_word_embeddings", True)
        cfg, cls = tf.Qwen3Config(**kw), tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        # Default init leaves biases and norm weights at 0 / 1; randomise them so that they are tested.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return path


def hf_reference(model_dir: Path, prompts: list[list[int]], max_new: int, process=None):
    """Per prompt: (logits over the prompt [L, V], greedy continuation, log-probs of those tokens, the
    raw log-softmax at each generated position [max_new, V]). `process(input_ids [1, n], logits [1, V],
    prompt length)`, e.g. transformers' logits processors, picks the greedy token from processed logits;
    the log-probabilities stay those of the raw model distribution."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            prompt_logits = model(ids).logits[0]
            toks, lps, steps = [], [], []
            logits = prompt_logits[-1]
            for _ in range(max_new):
                chosen = logits if process is None else process(ids, logits[None].clone(), len(p))[0]
                t = int(chosen.argmax())
                logp = torch.log_softmax(logits.float(), -1)
                toks.append(t)
                lps.append(float(logp[t]))
                steps.append(logp)
                ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
                logits = model(ids).logits[0, -1]
            out.append((prompt_logits, toks, lps, torch.stack(steps)))
    return out


def run_under_interpreter(script: str, ok_marker: str, timeout: float) -> None:
    """Run a test module as a script in a fresh process with TRITON_INTERPRET=1 (Triton picks the
    interpreter when a kernel is defined, so the pytest process cannot switch) and require that it
    exits cleanly having printed `ok_marker`."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, script], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and ok_marker in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ---- the OpenAI server tests' demo server (test_server_openai.py, test_server_processes.py) ----------
DEMO_MAX_LEN = 256
DEMO_SERVER_ARGS = ["--max-model-len", str(DEMO_MAX_LEN), "--max-num-seqs", "32", "--no-access-log", "--log-level",
                    "warning", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
DEMO_PROMPTS = ["The tensor-parallel engine says:", "Hello, world", "0123456789"]


def greedy_completion(client, prompt, n_tokens=24, extra=None, **kw):
    """`n_tokens` greedy tokens (past end-of-sequence) of `prompt` through an OpenAI client of the demo server."""
    return client.completions.create(model="demo", prompt=prompt, max_tokens=n_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **(extra or {})}, **kw)


def assert_openai_error(r, status, *fragments, param=None):
    """`r` (an httpx response) is OpenAI's error body with `status`, its message holding each fragment."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    for f in fragments:
        assert f in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def fail_steps_once_flagged(flag_path: str, engine) -> None:
    """An AsyncLLM `core_setup` (with functools.partial): once `flag_path` exists, every model step of
    the engine core raises "injected device fault", as a broken device would."""
    execute = engine.runner.execute

    def maybe_broken(step):
        if os.path.exists(flag_path):
            raise RuntimeError("injected device fault")
        return execute(step)

    engine.runner.execute = maybe_broken


def process_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def slow_grammar_compiles(delay_s: float, engine) -> None:
    """An AsyncLLM `core_setup` (with functools.partial): every grammar compile in the engine core takes
    `delay_s` longer, so that a test can act while one is in progress."""
    compile_ = engine.structured.compile

    def slow(so):
        time.sleep(delay_s)
        return compile_(so)

    engine.structured.compile = slow
