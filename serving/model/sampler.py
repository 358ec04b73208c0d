"""Batched sampling on the device.

One call per step for the whole batch: the logits are processed (structured-output mask, logit bias,
repetition / frequency / presence penalties), then sampled (greedy, temperature, top-k, top-p, min-p,
per-request seeds). Log-probabilities are of the raw model distribution, before any processing (vLLM's
default): the sampled token's, and the top `top_logprobs` alternatives.

vLLM's allowed_token_ids is a bias too: -inf on every other token.

What the penalties and the bias read about a sequence lives in `TokenState`: rows of device tensors that
the engine hands to sequences which need them. A step adds its sampled tokens to their rows on the
device, so the next step, launched before the host has seen those tokens (async scheduling), already
counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..config import SamplingParams


@dataclass
class Sampled:
    """A step's draw, on the logits' device (nothing read back yet)."""

    tokens: torch.Tensor                        # [B] int64
    logprobs: Optional[torch.Tensor] = None     # [B] float32, when any request asked
    top_ids: Optional[torch.Tensor] = None      # [B, K] int64, K the batch's largest top_logprobs
    top_logprobs: Optional[torch.Tensor] = None  # [B, K] float32, best first


class TokenState:
    """Per-sequence rows on the device: output token counts (frequency / presence penalties), the set
    of prompt tokens (repetition penalty counts prompt and output), and the logit bias (with -inf on the
    tokens outside allowed_token_ids). A row belongs
    to one sequence from its first sampled token until it finishes or is preempted; a preempted
    sequence gets a fresh row, rebuilt from its tokens, when it samples again. Each buffer is
    allocated on the first request that needs it: max_num_seqs x vocabulary elements."""

    def __init__(self, rows: int, vocab_size: int, device):
        self.num_rows, self.vocab_size, self.device = rows, vocab_size, torch.device(device)
        self._free = list(range(rows - 1, -1, -1))
        self.counts: Optional[torch.Tensor] = None      # [rows, V] int32
        self.in_prompt: Optional[torch.Tensor] = None   # [rows, V] bool
        self.bias: Optional[torch.Tensor] = None        # [rows, V] float32

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams) -> int:
        """A row for a sequence whose tokens so far are all on the host."""
        if not self._free:
            raise RuntimeError(f"all {self.num_rows} sampling-state rows are in use (max_num_seqs)")
        row = self._free.pop()
        shape, dev = (self.num_rows, self.vocab_size), self.device
        if params.penalized and self.counts is None:
            self.counts = torch.zeros(shape, dtype=torch.int32, device=dev)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=dev)
        if (params.logit_bias or params.allowed_token_ids is not None) and self.bias is None:
            self.bias = torch.zeros(shape, dtype=torch.float32, device=dev)
        # Every buffer's row is reset, also those this sequence does not use: the sampler applies them
        # to every row it is given, and an unused row must be neutral.
        if self.counts is not None:
            self.counts[row].zero_()
            self.in_prompt[row].zero_()
            self.in_prompt[row, torch.tensor(list(prompt_ids), dtype=torch.int64, device=dev)] = True
            if output_ids:
                out = torch.tensor(list(output_ids), dtype=torch.int64, device=dev)
                self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if self.bias is not None:
            self.bias[row].zero_()
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=dev)
                self.bias[row, ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32,
                                                   device=dev)
            if params.allowed_token_ids is not None:
                others = torch.ones(self.vocab_size, dtype=torch.bool, device=dev)
                others[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=dev)] = False
                self.bias[row].masked_fill_(others, float("-inf"))
        return row

    def release(self, row: int) -> None:
        # A step still in flight may add its token to this row; whoever gets it next resets it on the
        # same stream, after that step's update.
        self._free.append(row)

    def apply(self, x: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor,
              params: Sequence[SamplingParams]) -> None:
        """x[batch_rows] (float32, modified in place) gets its sequences' bias, then penalties.
        `params` are those of batch_rows, in order."""
        xs = x.index_select(0, batch_rows)
        if self.bias is not None:
            xs += self.bias.index_select(0, state_rows)
        if self.counts is not None:
            dev = x.device
            counts = self.counts.index_select(0, state_rows)
            generated = counts > 0
            rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
            seen = generated | self.in_prompt.index_select(0, state_rows)
            xs = torch.where(seen, torch.where(xs > 0, xs / rep, xs * rep), xs)
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
            xs -= freq * counts + pres * generated
        x.index_copy_(0, batch_rows, xs)

    def record(self, state_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the sampled tokens (the rows are distinct: one token per sequence per step)."""
        if self.counts is not None:
            self.counts.index_put_((state_rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                   accumulate=True)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]], default_gen: torch.Generator,
           ) -> tuple[list[int], list[Optional[float]]]:
    """logits [B, V] -> (token ids, log-probability of each chosen token under the raw model
    distribution, or None for requests that did not ask for logprobs)."""
    out = sample_on_device(logits, params, generators, default_gen)
    lps = out.logprobs.tolist() if out.logprobs is not None else [None] * len(params)
    return out.tokens.tolist(), [lp if p.logprobs else None for lp, p in zip(lps, params)]


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[Optional[torch.Generator]], default_gen: torch.Generator,
                     state: Optional[TokenState] = None, state_rows: Optional[Sequence[int]] = None,
                     token_bitmask: Optional[torch.Tensor] = None,
                     masked: Optional[Sequence[int]] = None, banned: Optional[torch.Tensor] = None) -> Sampled:
    """Process and sample logits [B, V] without reading anything back, so that the next step can be
    launched before the host sees the tokens.

    state, state_rows: the TokenState row of each batch row (-1: none), for bias and penalties.
    token_bitmask, masked: an int32 [B, ceil(V/32)] bitmask on the logits' device (bit j of a row set:
    token j allowed) and the batch rows it constrains (structured output).
    banned: int64 [2, n], (batch row, token id) pairs that cannot be drawn this step (min_tokens)."""
    want_lp = any(p.logprobs for p in params)
    k = min(max((p.top_logprobs for p in params), default=0), logits.shape[-1])
    # Raw model distribution: taken before any processing.
    logp = torch.log_softmax(logits.float(), dim=-1) if want_lp else None
    with_state = [i for i, r in enumerate(state_rows or ()) if r >= 0] if state is not None else []
    processed = bool(with_state) or bool(masked) or banned is not None
    x = logits
    if processed:
        # A copy: the step's logits may also be a request's prompt logits.
        x = logits.float() if logits.dtype != torch.float32 else logits.clone()
        dev = x.device
        if masked:
            _apply_bitmask(x, token_bitmask, masked)
        if banned is not None:
            x[banned[0].to(dev), banned[1].to(dev)] = float("-inf")
        if with_state:
            batch_rows = torch.tensor(with_state, dtype=torch.int64, device=dev)
            rows = torch.tensor([state_rows[i] for i in with_state], dtype=torch.int64, device=dev)
            state.apply(x, batch_rows, rows, [params[i] for i in with_state])
    if all(p.greedy for p in params):
        # the common decode case: one argmax (no fp32 copy, no softmax unless logprobs were asked for)
        tokens = x.argmax(dim=-1)
    else:
        tokens = _draw(x.float(), params, generators, default_gen)
    if with_state:
        state.record(rows, tokens.index_select(0, batch_rows))
    out = Sampled(tokens)
    if want_lp:
        out.logprobs = logp.gather(1, tokens[:, None])[:, 0]
        if k:
            out.top_logprobs, out.top_ids = logp.topk(k, dim=-1)
    return out


def _apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(x, bitmask, vocab_size=x.shape[-1], indices=list(rows))


def _draw(x: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
          default_gen: torch.Generator) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and the draw, on float32 logits; greedy rows take the argmax."""
    b = x.shape[0]
    dev = x.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    tokens = x.argmax(dim=-1)
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    x = x / temp[:, None]
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
    return torch.where(greedy, tokens, drawn)
