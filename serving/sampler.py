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
    want_lp = any(p.logprobs for p in params)
    if all(p.greedy for p in params):
        # the common decode case, kept to one kernel and one device-to-host copy (no fp32 copy of
        # the logits, no softmax over the vocabulary unless someone asked for logprobs)
        tokens = logits.argmax(dim=-1)
        if not want_lp:
            return tokens.tolist(), [None] * len(params)
        return _with_logprobs(logits, tokens)
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
    if not want_lp:
        return tokens.tolist(), [None] * len(params)
    return _with_logprobs(logits, tokens)


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[list[int], list[float]]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist()
