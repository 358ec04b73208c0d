"""The shapes `tune` and the bench scripts measure: the dims of the model configs shipped with the engine
(serving/model/model_configs). A model's shard shapes themselves are tp_overlap_plugin/shapes.py's."""

from __future__ import annotations

import json

# (serving/config.py imports neither the engine nor Triton: the bench scripts set up first)
from tp_overlap_plugin.serving.config import SHIPPED_CONFIGS as MODEL_CONFIGS
from tp_overlap_plugin.shapes import ModelDims

# the TP sizes a shipped config table covers: every size one 8-GPU host serves a model at
SHIPPED_TPS = (1, 2, 4, 8)


def shipped_names() -> list[str]:
    """The configs shipped with the engine, by name. The demo model is not one: it is made in code for
    the CPU, and no table measures its shapes on a GPU."""
    return sorted(p.parent.name for p in MODEL_CONFIGS.glob("*/config.json"))


def shipped_dims(name: str) -> ModelDims:
    """The dims of a config shipped with the engine (llama-3-8b, llama-3-70b, qwen2.5-7b)."""
    path = MODEL_CONFIGS / name / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no shipped model config {name!r}; shipped: {shipped_names()}")
    return ModelDims.from_hf(json.loads(path.read_text()))


def shipped_models() -> dict[str, tuple[ModelDims, tuple[int, ...]]]:
    """{name: (dims, the SHIPPED_TPS it can run at)} of every shipped config: a TP size that does not
    divide its heads or MLP width (Qwen2.5-7B's 28 heads at TP=8) has no shard shapes to measure."""
    out = {}
    for name in shipped_names():
        dims = shipped_dims(name)
        out[name] = (dims, tuple(tp for tp in SHIPPED_TPS if _divides(dims, tp)))
    return out


def _divides(dims: ModelDims, tp: int) -> bool:
    try:
        dims.check_tp(tp)
    except ValueError:
        return False
    return True
