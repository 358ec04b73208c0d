"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]], default_gen: torch.Generator,
           ) -> tuple[list[int], list[Optional[float]]]:
    """logits [B, V] -> (token ids, log-probability of each chosen token under the raw model
    distribution, or None for requests that did not ask for logprobs)."""
    tokens, lps = sample_on_device(logits, params, generators, default_gen)
    return tokens.tolist(), (lps.tolist() if lps is not None else [None] * len(params))


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[Optional[torch.Generator]], default_gen: torch.Generator,
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`sample` without reading anything back: (token ids [B] int64, log-probabilities [B] float32 or
    None when no request asked), both on the logits' device, so that the next step can be launched
    before the host sees them."""
    want_lp = any(p.logprobs for p in params)
    if all(p.greedy for p in params):
        # the common decode case, kept to one kernel (no fp32 copy of the logits, no softmax over
        # the vocabulary unless someone asked for logprobs)
        tokens = logits.argmax(dim=-1)
        return tokens, (_logprobs(logits, tokens) if want_lp else None)
    logits = logits.float()
    b = logits.shape[0]
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    tokens = logits.argmax(dim=-1)
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    x = logits / temp[:, None]
    top_k = [p.top_k for p in params]
    if any(top_k):
        v = x.shape[-1]
        k = torch.tensor([min(t, v) if t > 0 else v for t in top_k], device=dev)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = [p.top_p for p in params]
    if any(t < 1.0 for t in top_p):
        sp, idx = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already cover top_p; the top token always stays.
        above = sp.cumsum(dim=-1) - sp
        drop = above > torch.tensor(top_p, device=dev)[:, None]
        probs = probs.scatter(1, idx, sp.masked_fill(drop, 0.0))
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        cut = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < cut, 0.0)
    # argmax(p / E) with E ~ Exp(1) draws from p; per-row noise keeps seeded requests reproducible
    # regardless of which other requests share the batch.
    noise = torch.empty_like(probs).exponential_(generator=default_gen)
    for i in range(b):
        if generators[i] is not None:
            noise[i].exponential_(generator=generators[i])
    drawn = (probs / noise).argmax(dim=-1)
    tokens = torch.where(greedy, tokens, drawn)
    return tokens, (_logprobs(logits, tokens) if want_lp else None)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, tokens[:, None])[:, 0]
