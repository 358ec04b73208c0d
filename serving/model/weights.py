"""Weight loading: local safetensors straight into each rank's shard, dummy weights, demo weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .model import CausalLM

# Checkpoint entries that are not parameters of the model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_safetensors(model: CausalLM, model_dir: Path, show_progress: bool = True) -> None:
    from safetensors import safe_open
    from tqdm import tqdm

    params = model.checkpoint_params()
    seen: set[str] = set()
    files = _safetensor_files(model_dir)
    for path in tqdm(files, desc="loading weights", unit="file", disable=not show_progress):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                        continue
                    raise KeyError(f"checkpoint tensor {name!r} in {path.name} has no place in the model")
                module, shard_id, is_bias, _ = params[name]
                # get_slice reads only the rows/columns this rank keeps.
                module.load_shard(f.get_slice(name), shard_id, is_bias=is_bias)
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint in {model_dir} lacks {missing[:5]}{more}")


def load_state_dict(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    params = model.checkpoint_params()
    for name, (module, shard_id, is_bias, _) in params.items():
        module.load_shard(state[name], shard_id, is_bias=is_bias)


def load_demo(model: CausalLM) -> None:
    from .demo import demo_state_dict
    params = model.checkpoint_params()
    load_state_dict(model, demo_state_dict([(n, p[3]) for n, p in params.items()]))


def load_dummy(model: CausalLM, seed: int, rank: int) -> None:
    """Random local shards, generated in place: fast for big benchmark models; values differ per TP size."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed * 1009 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                scale = 1.0 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.02
                p.uniform_(-scale, scale, generator=g)
