"""`tp-overlap generate`: offline generation with the built-in engine.

    tp-overlap generate --prompt "Hello"                          # embedded demo model, nothing downloaded
    tp-overlap generate --model /models/Llama-3.1-8B --tp 2 --prompt "Hi" --chat
    torchrun --nproc-per-node 2 -m tp_overlap_plugin.cli generate --model ... --tp 2 --prompt "Hi"
"""

from __future__ import annotations

import argparse
import sys
import time

from pydantic import ValidationError

from tp_overlap_plugin.serving.config import EngineConfig, SamplingParams
from tp_overlap_plugin.serving.user_errors import CliError

from .engine_args import add_engine_args, describe_validation_error, engine_config_from_args
from .parser import add_debug_arg

DEFAULT_PROMPT = "The tensor-parallel engine says:"
# SamplingParams field -> the option that sets it, so that a validation error names what the user typed
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
                   "top_p": "--top-p", "min_p": "--min-p", "seed": "--sample-seed", "stop": "--stop"}


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--prompt", action="append", default=None, help="repeatable; default: one demo prompt")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of the sampling (default: the engine's)")
    g.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past end-of-sequence")
    add_debug_arg(p)
    p.set_defaults(func=run_generate)


def sampling_params_from_args(a: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                              min_p=a.min_p, seed=a.sample_seed, stop=a.stop, ignore_eos=a.ignore_eos)
    except ValidationError as e:
        raise CliError(describe_validation_error(e, _SAMPLING_FLAGS)) from None


def run_generate(a: argparse.Namespace) -> int:
    cfg = engine_config_from_args(a)
    return generate(cfg, sampling_params_from_args(a), a.prompt or [DEFAULT_PROMPT], chat=a.chat)


def generate(cfg: EngineConfig, sp: SamplingParams, prompts: list[str], chat: bool = False) -> int:
    """Generate for each prompt and print the texts (stdout) and the rate (stderr)."""
    from tp_overlap_plugin.serving.engine.llm import LLM

    llm = LLM(cfg)
    if not llm.is_driver:      # a torchrun worker rank: it served rank 0 until shutdown
        return 0
    try:
        t0 = time.perf_counter()
        if chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
        else:
            outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        n = 0
        for o in outs:
            c = o.outputs[0]
            n += len(c.token_ids)
            print(f"--- prompt: {o.prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
        print(f"{n} tokens in {dt:.2f} s ({n / max(dt, 1e-9):.1f} tok/s)", file=sys.stderr)
    finally:
        llm.shutdown()
    return 0


def add_generate_subcommand(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="offline generation with the built-in engine")
    add_generate_args(p)
    return p
