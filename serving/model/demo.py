"""The embedded default model: a tiny Llama-shaped decoder with seeded random weights.

The weights are generated as a full (unsharded) state dict from a fixed seed and then go through the
same sharding loader as a checkpoint, so every TP size serves the very same model.
"""

from __future__ import annotations

import torch

DEMO_SEED = 1234
# The byte tokenizer's <|bos|> and <|eos|> (tokenizer.ByteTokenizer; a test checks they agree). Written
# here, not read from it: the engine core reads this config and builds no tokenizer.
BOS_ID, EOS_ID = 256, 257


def demo_hf_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def demo_state_dict(hf_names: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Seeded tensors for the given (name, shape) list; norms are ones, matrices small uniform."""
    g = torch.Generator().manual_seed(DEMO_SEED)
    out = {}
    for name, shape in hf_names:
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            scale = 1.0 / max(shape[-1], 1) ** 0.5
            out[name] = (torch.rand(shape, generator=g) * 2 - 1) * scale
    return out
