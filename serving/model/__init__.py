"""What a checkpoint is and how it computes: the decoder (model.py, written against the plugin's
`TPLayers`), paged attention (attention.py), safetensors loading and sharding (weights.py), the
sampler and its per-sequence state (sampler.py), the tokenizers and the incremental detokenizer
(tokenizer.py), the built-in demo model (demo.py) and the shipped model configs (model_configs/).

A model module may import `serving.config`, the plugin (`tp_overlap_plugin.layers`, `kernels`) and
the other model modules; never the worker, the engine or an entrypoint.
"""
