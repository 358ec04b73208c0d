"""Log-probabilities in the two APIs' shapes: the legacy completions' (token strings, {text: logprob} of the
alternatives, text offsets) and chat's (per token its text, bytes and top alternatives); and the prompt's
log-probabilities from its logits, for completions with `echo` and for vLLM's `prompt_logprobs`."""

from __future__ import annotations

import codecs
from typing import Optional

from .protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from .protocol_vllm import PromptLogprob, PromptLogprobs


class LogprobFormatter:
    """Formats one model's log-probabilities; `tokenizer` may be None (a model without one).

    A token's text is its bytes, decoded; a token whose bytes are not whole UTF-8 (a piece of a character,
    as byte-level tokenizers make) is written `bytes:\\xe2\\x80`, as OpenAI writes it. Decoded, every such
    piece would read U+FFFD, and the legacy API's {text: logprob} would keep one of them for all.

    `as_token_ids` (vLLM's return_tokens_as_token_ids): every token is written `token_id:<id>`, its bytes
    those of that string, as vLLM sends them."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def token_str(self, t: int) -> str:
        if self.tokenizer is None or self.as_token_ids:
            return f"token_id:{t}"
        raw = self.tokenizer.token_bytes(t)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, t: int) -> Optional[list[int]]:
        if self.as_token_ids:
            return list(self.token_str(t).encode())
        return list(self.tokenizer.token_bytes(t)) if self.tokenizer is not None else None

    def offsets(self, start: int = 0) -> "TextOffsets":
        return TextOffsets(self.tokenizer, start)

    def completion(self, ids: list[int], lps: list[Optional[float]],
                   tops: list[Optional[list[tuple[int, float]]]], offsets: "TextOffsets") -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, log-probability, {text: logprob} of the `logprobs`
        most likely tokens plus the sampled one, and its offset in the text (`offsets` goes on counting
        from the tokens it saw before: a stream passes the same one for each chunk)."""
        out = CompletionLogprobs(text_offset=[offsets.next(t) for t in ids])
        tops = list(tops) + [None] * (len(ids) - len(tops))   # (none asked for: an empty list)
        for t, lp, top in zip(ids, lps, tops):
            s = self.token_str(t)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            if lp is None:
                out.top_logprobs.append(None)
            else:
                # (Distinct tokens have distinct bytes in the vocabularies this engine reads; should two
                # still read alike, the likelier keeps the key.)
                alts: dict[str, float] = {}
                for alt, alt_lp in top or []:
                    alts.setdefault(self.token_str(alt), alt_lp)
                alts.setdefault(s, lp)
                out.top_logprobs.append(alts)
        return out

    def chat(self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> ChatChoiceLogprobs:
        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            alts = [ChatTopLogprob(token=self.token_str(a), logprob=alp, bytes=self.token_bytes(a))
                    for a, alp in (tops[i] if i < len(tops) else [])]
            content.append(ChatTokenLogprob(token=self.token_str(t), logprob=lp, bytes=self.token_bytes(t),
                                            top_logprobs=alts))
        return ChatChoiceLogprobs(content=content)


    def prompt(self, ids: list[int], prompt_logits, k: int) -> PromptLogprobs:
        """vLLM's `prompt_logprobs`: None for the first token, then per token {token id: its logprob,
        rank, text} for the prompt's token and the k most likely ones (rank 1: the likeliest)."""
        import torch

        out: PromptLogprobs = [None]
        if prompt_logits is None or len(ids) < 2:
            return out + [None] * (len(ids) - 1)
        lp = torch.log_softmax(prompt_logits[:len(ids) - 1].float(), dim=-1)
        actual = torch.tensor(ids[1:])[:, None]
        chosen = lp.gather(1, actual)
        ranks = (lp > chosen).sum(dim=-1) + 1
        tops = lp.topk(k, dim=-1) if k else None
        for i, t in enumerate(ids[1:]):
            entry = {str(t): PromptLogprob(logprob=chosen[i, 0].item(), rank=int(ranks[i]),
                                           decoded_token=self.token_str(t))}
            if tops is not None:
                for r, (alt, alp) in enumerate(zip(tops.indices[i].tolist(), tops.values[i].tolist()), 1):
                    entry.setdefault(str(alt), PromptLogprob(logprob=alp, rank=r, decoded_token=self.token_str(alt)))
            out.append(entry)
        return out


class TextOffsets:
    """Where each token of one text starts in it: the characters that the tokens before it decided. A token
    inside a character comes before the character is decided, so it starts where that character does;
    special tokens add no text."""

    def __init__(self, tokenizer, start: int = 0):
        self.tokenizer = tokenizer
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, t: int) -> int:
        """Token `t`'s offset; counts its text for the next one."""
        at = self.at
        if self.tokenizer is not None and self.tokenizer.decode([t]):   # (empty: a special token)
            self.at += len(self._decoder.decode(self.tokenizer.token_bytes(t)))
        return at


def prompt_logprobs(ids: list[int], prompt_logits, k: int) -> tuple[list[Optional[float]], list]:
    """The prompt tokens' log-probabilities (the first has none) and their top k alternatives."""
    import torch

    if prompt_logits is None or len(ids) < 2:
        return [None] * len(ids), [None] * len(ids)
    lp = torch.log_softmax(prompt_logits[:len(ids) - 1].float(), dim=-1)
    nxt = torch.tensor(ids[1:])[:, None]
    tops: list = [None]
    if k:
        vals, idx = lp.topk(k, dim=-1)
        tops += [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops += [[] for _ in ids[1:]]
    return [None] + lp.gather(1, nxt)[:, 0].tolist(), tops
