"""The engine's command-line options, shared by `serve`, `generate` and the offline benches.

One module that the subcommands import (and that imports none of them), so that cli.py, api_server.py
and bench_offline.py do not import each other.
"""

from __future__ import annotations

import argparse
import json

from .config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model,
                   help="'demo' (built in), a local HF model directory, or a shipped config name "
                        "(llama-3-8b, llama-3-70b, qwen2.5-7b; with --load-format dummy)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default=d.load_format)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype)
    g.add_argument("--device", dest="engine_device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes, help="KV cache budget per rank on CPU")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="launch step i+1 before step i's tokens reach the host (the host works while the GPU does)")
    g.add_argument("--tp-overlap", action="store_true",
                   help="overlapped TP kernels over the symmetric heap (also: TP_OVERLAP=1)")
    g.add_argument("--tp-overlap-config", default=None, metavar="JSON",
                   help='sub-config, e.g. \'{"dispatch": "overlap", "heap_size": 1073741824}\'; implies --tp-overlap')


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    extra = {}
    if a.tp_overlap_config is not None:
        extra["tp_overlap"] = json.loads(a.tp_overlap_config)
    elif a.tp_overlap:
        extra["tp_overlap"] = True
    return EngineConfig(**extra, model=a.model, tokenizer=a.tokenizer, tensor_parallel_size=a.tp,
                        load_format=a.load_format, dtype=a.dtype, device=a.engine_device,
                        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                        gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_bytes=a.kv_cache_bytes,
                        num_kv_blocks=a.num_kv_blocks, seed=a.seed, enforce_eager=a.enforce_eager,
                        async_scheduling=a.async_scheduling)
