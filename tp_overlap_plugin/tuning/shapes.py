"""The shapes `tune` and the bench scripts measure: the dims of the model configs shipped with the engine
(serving/model/model_configs). A model's shard shapes themselves are tp_overlap_plugin/shapes.py's."""

from __future__ import annotations

import json

# (serving/config.py imports neither the engine nor Triton: the bench scripts set up first)
from tp_overlap_plugin.serving.config import SHIPPED_CONFIGS as MODEL_CONFIGS
from tp_overlap_plugin.shapes import ModelDims


def shipped_dims(name: str) -> ModelDims:
    """The dims of a config shipped with the engine (llama-3-8b, llama-3-70b, qwen2.5-7b)."""
    path = MODEL_CONFIGS / name / "config.json"
    if not path.is_file():
        known = sorted(p.parent.name for p in MODEL_CONFIGS.glob("*/config.json"))
        raise FileNotFoundError(f"no shipped model config {name!r}; shipped: {known}")
    return ModelDims.from_hf(json.loads(path.read_text()))
