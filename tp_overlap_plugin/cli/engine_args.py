"""The engine's options (used by `serve`, `generate` and the offline benches) and their turning into an
EngineConfig, with the checks that would otherwise fail only after the engine's processes start, said
in the options' terms."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import typing
from typing import Optional

from pydantic import ValidationError

from tp_overlap_plugin.serving.config import EngineConfig, MissingWeights
from tp_overlap_plugin.serving.user_errors import CliError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model,
                   help="'demo' (built in), a local HF model directory, a Hugging Face Hub id (org/name; "
                        "its cache, HF_HOME and HF_HUB_OFFLINE apply), or a shipped config name "
                        "(llama-3-8b, llama-3-70b, qwen2.5-7b; with --load-format dummy)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size: ranks (one process each); must divide the head counts")
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default=d.load_format,
                   help="dummy: random weights (benchmarks of a shipped config)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype,
                   help="auto: float32 on the CPU; on a GPU the checkpoint's bfloat16 or float16, else bfloat16")
    g.add_argument("--device", dest="engine_device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="auto: cuda when a GPU is present")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences in one batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens in one step at most; longer prompts are prefilled in chunks")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of GPU memory the weights and the KV cache may take")
    g.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes, help="KV cache budget per rank on CPU")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: as many as the memory budget holds)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's sampler")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=d.piecewise_cuda_graphs,
                   help="prefill and mixed steps replay all but attention from CUDA graphs per token-count bucket")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="launch step i+1 before step i's tokens reach the host (the host works while the GPU does)")
    g.add_argument("--tp-overlap", action="store_true",
                   help="overlapped TP kernels over the symmetric heap (also: TP_OVERLAP=1). Each op takes the path "
                        "a dispatch table measured on this device and TP size chose: until `tp-overlap tune` has made "
                        "one here (or one ships for it, tp_overlap_plugin/dispatch_tables/), the flag runs the stock "
                        "path, and says so at start-up")
    g.add_argument("--tp-overlap-config", default=None, metavar="JSON",
                   help="the flag's options as a JSON object, e.g. '{\"dispatch\": \"overlap\", \"heap_size\": "
                        f"1073741824}}'; implies --tp-overlap. Keys: {_tp_overlap_keys()}")


def _tp_overlap_keys() -> str:
    """--tp-overlap-config's keys for --help, from the options' own model (so that the two cannot drift)."""
    from tp_overlap_plugin.options import TPOverlapOptions

    hints = typing.get_type_hints(TPOverlapOptions)
    parts = []
    for f in dataclasses.fields(TPOverlapOptions):
        if f.name == "enabled":
            continue
        annotation = hints[f.name]
        optional = typing.get_origin(annotation) is typing.Union
        inner = [t for t in typing.get_args(annotation) if t is not type(None)] if optional else [annotation]
        literal = next((t for t in inner if typing.get_origin(t) is typing.Literal), None)
        values = (" | ".join(f'"{v}"' for v in typing.get_args(literal)) if literal is not None
                  else {int: "int", float: "float", str: "str"}.get(inner[0], ""))
        default = f", default {json.dumps(f.default)}" if f.default is not None else ""
        parts.append(f"{f.name} ({values}{default}): {f.metadata['help']}.")
    return " ".join(parts)


# EngineConfig field -> the option that sets it, so that a validation error names what the user typed.
_FLAGS = {"model": "--model", "tokenizer": "--tokenizer", "tensor_parallel_size": "--tp",
          "load_format": "--load-format", "dtype": "--dtype", "device": "--device",
          "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
          "max_num_batched_tokens": "--max-num-batched-tokens", "block_size": "--block-size",
          "gpu_memory_utilization": "--gpu-memory-utilization", "kv_cache_bytes": "--kv-cache-bytes",
          "num_kv_blocks": "--num-kv-blocks", "seed": "--seed", "tp_overlap": "--tp-overlap-config",
          "piecewise_cuda_graphs": "--piecewise-cuda-graphs"}


def describe_validation_error(e: ValidationError, flags: Optional[dict[str, str]] = None) -> str:
    """pydantic's multi-line report as one line, each problem under the option (or field) it is about."""
    flags = _FLAGS if flags is None else flags
    parts = []
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ())]
        where = flags.get(loc[0], loc[0]) if loc else ""
        if len(loc) > 1:
            where += " " + ".".join(loc[1:])
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict) or value is None else f" (got {value!r})"
        parts.append(f"{where}: {msg}{shown}" if where else msg)
    return "; ".join(parts)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options describe; CliError (naming the option) when they do not make one."""
    extra = {}
    if a.tp_overlap_config is not None:
        try:
            extra["tp_overlap"] = json.loads(a.tp_overlap_config)
        except json.JSONDecodeError as e:
            raise CliError(f"--tp-overlap-config is not valid JSON ({e}): {a.tp_overlap_config!r}",
                           hint='quote the JSON for the shell, e.g. --tp-overlap-config \'{"dispatch": "overlap"}\''
                           ) from None
    elif a.tp_overlap:
        extra["tp_overlap"] = True
    try:
        cfg = EngineConfig(**extra, model=a.model, tokenizer=a.tokenizer, tensor_parallel_size=a.tp,
                           load_format=a.load_format, dtype=a.dtype, device=a.engine_device,
                           max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                           max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                           gpu_memory_utilization=a.gpu_memory_utilization, kv_cache_bytes=a.kv_cache_bytes,
                           num_kv_blocks=a.num_kv_blocks, seed=a.seed, enforce_eager=a.enforce_eager,
                           piecewise_cuda_graphs=a.piecewise_cuda_graphs,
                           async_scheduling=a.async_scheduling)
    except ValidationError as e:
        raise CliError(describe_validation_error(e), hint="--help lists the options and their defaults") from None
    check_engine_config(cfg)
    return cfg


def check_engine_config(cfg: EngineConfig) -> None:
    """What the engine would refuse only after spawning its processes (or loading weights), found first and
    said in the options' terms: --device cuda without a GPU, a --tp that does not divide the model, a model
    directory without weights."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        gpu_build = torch.version.cuda or torch.version.hip
        build = "" if gpu_build else f" (torch {torch.__version__} is built without CUDA)"
        raise CliError(f"--device cuda: torch sees no GPU on this machine{build}",
                       hint="--device cpu (or no --device) runs on the CPU")
    try:
        mcfg = cfg.load_model_config()
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None     # (it names the model)
    check_tp_option(mcfg, cfg.tensor_parallel_size)
    try:
        cfg.effective_load_format()
    except MissingWeights as e:
        raise CliError(f"--model {cfg.model}: no weights (*.safetensors) in {e.directory}",
                       hint="--load-format dummy runs it with random weights") from None
    except FileNotFoundError as e:
        raise CliError(str(e)) from None


def check_tp_option(mcfg, tp: int) -> None:
    """CliError unless --tp `tp` divides the head counts and MLP width of `mcfg` (a ModelConfig), listing
    the sizes that do."""
    sizes = {"attention heads": mcfg.num_heads, "KV heads": mcfg.num_kv_heads,
             "MLP columns (intermediate_size)": mcfg.intermediate_size}
    bad = [f"{n} {what}" for what, n in sizes.items() if n % tp]
    if bad:
        common = functools.reduce(math.gcd, sizes.values())
        fits = [str(d) for d in range(1, min(common, 64) + 1) if common % d == 0]
        raise CliError(f"--tp {tp} does not divide the model's {', '.join(bad)}; --tp can be {', '.join(fits)}")
