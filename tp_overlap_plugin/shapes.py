"""A model's local matmuls as one rank holds them at TP=W, from its architecture numbers (an HF
config.json's, as the engine reads them): column-parallel layers (qkv, gate_up) divide N by W,
row-parallel layers (o_proj, down) divide K, the LM head its vocabulary rows. Every architecture the
engine loads (Llama, Mistral, Qwen2, Qwen3) has these five, so the tables are keyed by (K, N) and
serve any model whose shard shapes were measured: the engines name these shapes when they look a
table up, `tune` when it measures one."""

from __future__ import annotations

from dataclasses import dataclass

# op per layer: "ag" (column-parallel: AG-GEMM in the sharded layout), "rs" (row-parallel: GEMM-RS)
LAYER_OPS = {"qkv": "ag", "o_proj": "rs", "gate_up": "ag", "down": "rs"}


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelDims":
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"])

    @classmethod
    def of(cls, mcfg) -> "ModelDims":
        """From the engine's ModelConfig (anything with its attribute names)."""
        return cls(hidden=mcfg.hidden_size, intermediate=mcfg.intermediate_size, num_heads=mcfg.num_heads,
                   num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim, vocab=mcfg.vocab_size)

    def check_tp(self, world: int) -> None:
        for name, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate)):
            if n % world:
                raise ValueError(f"TP={world} does not divide {name}={n}")

    def layers(self, world: int) -> list[tuple[str, int, int]]:
        """(layer, K, N) of this rank's weights: qkv, o_proj, gate_up, down (the decoder's, in order)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("qkv", self.hidden, (q + 2 * kv) // world), ("o_proj", q // world, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate // world), ("down", self.intermediate // world, self.hidden)]

    def lm_head(self, world: int) -> tuple[str, int, int]:
        return ("lm_head", self.hidden, -(-self.vocab // world))
