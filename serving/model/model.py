"""Llama-family dense decoder (Llama 2/3, Mistral-style, Qwen2, Qwen3) built from TP layers.

The file only composes modules handed out by a `TPLayers` factory; where the tensors live and where
communication happens is the factory's business (see tp_overlap_plugin/layers.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from tp_overlap_plugin.kernels import layer_ops
from tp_overlap_plugin.layers import PendingAllReduce, TPLayers

from .attention import AttnMeta, paged_attention, write_kv
from ..config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def load_shard(self, loaded, shard_id=None, *, is_bias=False) -> None:
        with torch.no_grad():
            self.weight.copy_(loaded[:].to(self.weight.dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """weight * rmsnorm(x); with `residual`, of x + residual, returning (normed, x + residual).
        x may be a row layer's PendingAllReduce: its all-reduce, the add and the norm are then one
        kernel (tp_overlap_plugin.layers)."""
        if isinstance(x, PendingAllReduce):
            return x.add_rmsnorm(residual, self.weight, self.eps)
        if x.device.type != "cpu" and x.dim() == 2 and x.stride(-1) == 1:
            return layer_ops.rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            residual = x + residual
            return self.forward(residual), residual
        # Normalise in float32 and cast back before the weight, the order HF uses, so bf16 matches too.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, device):
        super().__init__()
        inv = rope_inv_freq(cfg).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D]; rotate-half convention (HF checkpoints are stored for it)."""
        cos = self.cos.index_select(0, positions).to(x.dtype)[:, None]
        sin = self.sin.index_select(0, positions).to(x.dtype)[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayers, rotary: Rotary):
        super().__init__()
        w = tp.tp.world_size
        self.heads = cfg.num_heads // w
        self.kv_heads = cfg.num_kv_heads // w
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        hd = cfg.head_dim
        self.qkv_proj = tp.column(cfg.hidden_size, [cfg.num_heads * hd, cfg.num_kv_heads * hd,
                                                    cfg.num_kv_heads * hd], bias=cfg.qkv_bias)
        self.o_proj = tp.row(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias, reduce_into_norm=True)
        self.rotary = rotary
        # the fused kernel takes a power-of-two head_dim (every Llama/Qwen size is one)
        self.fused_rope = hd & (hd - 1) == 0
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, tp.dtype, tp.device)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, tp.dtype, tp.device)
        else:
            self.q_norm = self.k_norm = None

    def project(self, positions, x, slot_mapping: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """x [T, hidden] -> rotated q [T, heads, head_dim]; k and v of the T tokens go into the cache.
        Everything of the attention block before attention itself: it depends on no per-step host
        value, so a CUDA graph may hold it (serving/worker/piecewise.py)."""
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.heads, self.head_dim)
        k = k.reshape(t, self.kv_heads, self.head_dim)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        if qkv.device.type != "cpu" and self.fused_rope:
            if self.q_norm is not None:  # back into the fused row the kernel rotates in place
                qkv[:, :q_size].copy_(q.reshape(t, q_size))
                qkv[:, q_size:q_size + kv_size].copy_(k.reshape(t, kv_size))
            layer_ops.rope_and_cache(qkv, self.heads, self.kv_heads, self.head_dim, positions, self.rotary.cos,
                                     self.rotary.sin, k_cache, v_cache, slot_mapping)
            return qkv[:, :q_size].reshape(t, self.heads, self.head_dim)
        q, k = self.rotary(positions, q), self.rotary(positions, k)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q

    def attend(self, q, meta: AttnMeta, kv_cache: tuple[torch.Tensor, torch.Tensor],
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, heads, head_dim] -> [T, heads * head_dim] (into `out` when given). Reads the step's
        per-sequence layout (meta): the part of a layer that runs eagerly between graph pieces."""
        t = q.shape[0]
        if out is not None:
            out = out.view(t, self.heads, self.head_dim)
        return paged_attention(q, *kv_cache, meta, self.scale, out=out).reshape(t, self.heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayers):
        super().__init__()
        self.gate_up_proj = tp.column(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = tp.row(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, reduce_into_norm=True)

    def forward(self, x):
        # the column layer applies the activation: the flag's layers can do it in the GEMM's epilogue
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayers, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp.dtype, tp.device)
        self.self_attn = Attention(cfg, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp.dtype, tp.device)
        self.mlp = MLP(cfg, tp)

    def before_attention(self, positions, hidden, residual, slot_mapping, kv_cache):
        """(hidden, residual) -> (q, residual): the input norm, which also adds the previous block's
        output into the residual stream (so the add costs no kernel of its own), and the projection."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.project(positions, hidden, slot_mapping, kv_cache), residual

    def after_attention(self, attn_out, residual):
        """Attention's output [T, heads * head_dim] -> (this block's output, residual)."""
        hidden = self.self_attn.o_proj(attn_out)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayers, max_positions: int):
        super().__init__()
        cfg.check_tp(tp.tp.world_size)
        self.cfg = cfg
        self.embed_tokens = tp.embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = Rotary(cfg, max_positions, tp.device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp.dtype, tp.device)
        self.lm_head = tp.lm_head(cfg.vocab_size, cfg.hidden_size,
                                  tied_to=self.embed_tokens if cfg.tie_word_embeddings else None)

    # The forward is split at attention into num_segments pieces, so that a runner can hold every
    # piece but attention in a CUDA graph per token count (serving/worker/piecewise.py): attention alone
    # depends on per-step host values (how many decodes, the longest chunk, the sequence split).
    # Segment 0 is the embedding and layer 0 up to attention; segment i (0 < i < L) layer i - 1 after
    # attention (o_proj, norm, MLP) and layer i up to attention; segment L the last layer after
    # attention, the final norm, and the LM head's gather of every token's row.
    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def segment(self, i: int, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                slot_mapping: torch.Tensor, kv_caches: list):
        """Segment i. x: the input ids for i = 0, else layer i - 1's attention output [T, heads * head_dim];
        residual: segment i - 1's. Returns (q of layer i, residual), or (final hidden, None) for the last."""
        if i == 0:
            hidden, residual = self.embed_tokens(x), None
        else:
            hidden, residual = self.layers[i - 1].after_attention(x, residual)
        if i == len(self.layers):
            return self.lm_head.token_rows(self.norm(hidden, residual)[0]), None
        return self.layers[i].before_attention(positions, hidden, residual, slot_mapping, kv_caches[i])

    def attend(self, i: int, q: torch.Tensor, meta: AttnMeta, kv_caches: list,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Layer i's attention between segments i and i + 1."""
        return self.layers[i].self_attn.attend(q, meta, kv_caches[i], out)

    def forward(self, input_ids, positions, meta: AttnMeta, kv_caches: list) -> torch.Tensor:
        """-> every token's final hidden row (compute_logits picks the rows to project)."""
        x, residual = input_ids, None
        for i in range(len(self.layers)):
            q, residual = self.segment(i, x, residual, positions, meta.slot_mapping, kv_caches)
            x = self.attend(i, q, meta, kv_caches)
        return self.segment(len(self.layers), x, residual, positions, meta.slot_mapping, kv_caches)[0]

    def compute_logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """hidden: forward's (or the last segment's) output."""
        return self.lm_head.logits(hidden, rows)

    def checkpoint_params(self) -> dict[str, tuple[nn.Module, Optional[int], bool, tuple[int, ...]]]:
        """HF checkpoint name -> (module, shard id within a merged matrix, is_bias, full shape)."""
        c = self.cfg
        hd, h = c.head_dim, c.hidden_size
        out: dict = {"model.embed_tokens.weight": (self.embed_tokens, None, False, (c.vocab_size, h)),
                     "model.norm.weight": (self.norm, None, False, (h,))}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = (self.lm_head, None, False, (c.vocab_size, h))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            sizes = {"q_proj": c.num_heads * hd, "k_proj": c.num_kv_heads * hd, "v_proj": c.num_kv_heads * hd}
            for sid, name in enumerate(("q_proj", "k_proj", "v_proj")):
                out[p + f"self_attn.{name}.weight"] = (a.qkv_proj, sid, False, (sizes[name], h))
                if c.qkv_bias:
                    out[p + f"self_attn.{name}.bias"] = (a.qkv_proj, sid, True, (sizes[name],))
            out[p + "self_attn.o_proj.weight"] = (a.o_proj, None, False, (h, c.num_heads * hd))
            if c.o_bias:
                out[p + "self_attn.o_proj.bias"] = (a.o_proj, None, True, (h,))
            if c.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (a.q_norm, None, False, (hd,))
                out[p + "self_attn.k_norm.weight"] = (a.k_norm, None, False, (hd,))
            for sid, name in enumerate(("gate_proj", "up_proj")):
                out[p + f"mlp.{name}.weight"] = (layer.mlp.gate_up_proj, sid, False, (c.intermediate_size, h))
                if c.mlp_bias:
                    out[p + f"mlp.{name}.bias"] = (layer.mlp.gate_up_proj, sid, True, (c.intermediate_size,))
            out[p + "mlp.down_proj.weight"] = (layer.mlp.down_proj, None, False, (h, c.intermediate_size))
            if c.mlp_bias:
                out[p + "mlp.down_proj.bias"] = (layer.mlp.down_proj, None, True, (h,))
            out[p + "input_layernorm.weight"] = (layer.input_layernorm, None, False, (h,))
            out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None, False, (h,))
        return out
