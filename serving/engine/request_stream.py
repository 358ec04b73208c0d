"""`RequestStream`: one request on the front end, from the core's token-id deltas to the
`RequestOutput`s a caller reads. It detokenizes, decides stop strings, and holds back text that could
still begin one.

Stop strings are decided here, not in the core: text exists only on this side. When one matches, the
stream finishes (finish_reason "stop") and its owner aborts the request in the core, which may have
computed a token or two more by then; they are dropped.

Streamed text equals the finished text. The text cut at a stop string must never have been sent, so
while a request runs the stream sends no suffix of its text that is the beginning of a stop string:
that tail waits until the next text shows it is not one (then it goes out) or completes the match
(then the output ends before it, or after it with include_stop_str_in_output). Every match starts
inside that held tail, so the cut never falls inside text already sent. Whatever is held goes out when
the output ends for another reason.
"""

from __future__ import annotations

from typing import Optional

from ..model.tokenizer import IncrementalDetokenizer
from .messages import OutputDelta, ProcessedRequest, TopLogprobs
from .outputs import CompletionOutput, RequestOutput


class RequestStream:
    """One request's text and outputs on the front end (module docstring)."""

    def __init__(self, request_id: str, request: ProcessedRequest, tokenizer):
        self.request_id = request_id
        self.prompt, self.prompt_ids, self.params = request.prompt, request.prompt_ids, request.params
        self.eos_ids = request.eos_ids
        self.detok = (IncrementalDetokenizer(tokenizer, request.prompt_ids, self.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stops = list(self.params.stop)
        self.longest_stop = max(map(len, self.stops), default=0)
        # With the stop string in the output, a match only ends the text: nothing before it is cut.
        self.holds_back = bool(self.stops) and not self.params.include_stop_str_in_output
        self.text = ""      # the text so far, cut at a stop string once one matched
        self.sent = 0       # how much of it the caller has seen
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.prompt_logits = None
        self.finish_reason: Optional[str] = None
        self.stop_reason = None   # vLLM's: the stop string that matched, or the stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, d: OutputDelta) -> RequestOutput:
        """The output after the core's delta `d`. It is finished when `d` is, or when a stop string
        matched in its text (finish_reason "stop" while `d.finished` is False): the caller then aborts
        the request in the core."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} already finished")
        if d.prompt_logits is not None:
            self.prompt_logits = d.prompt_logits
        ids, reason = d.token_ids, d.finish_reason
        taken = len(ids)
        for k, tok in enumerate(ids):
            last = k == len(ids) - 1
            # The core's "stop" means the last token is an end-of-sequence or stop token: it is no text.
            piece = "" if (last and reason == "stop") or self.detok is None else self.detok.push(tok)
            if last and reason in ("stop", "length") and self.detok is not None:
                # Bytes held back for a character that might continue are final now.
                piece += self.detok.flush()
            # (apiext) vLLM's min_tokens: no stop string ends the output before that many tokens are out.
            if self._add_text(piece, match=len(self.token_ids) + k + 1 > self.params.min_tokens):
                taken, reason = k + 1, "stop"
                break
        if reason == "stop" and d.finish_reason == "stop" and taken == len(ids) and ids:
            # The core stopped on a token: a stop token id is named, the end-of-sequence is not (vLLM's
            # order: the end-of-sequence first).
            tok, p = ids[-1], self.params
            if tok in p.stop_token_ids and (p.ignore_eos or tok not in self.eos_ids):
                self.stop_reason = tok
        new_ids = list(ids[:taken])
        self.token_ids += new_ids
        if d.logprobs:
            self.logprobs += d.logprobs[:taken]
        if d.top_logprobs:
            self.top_logprobs += d.top_logprobs[:taken]
        self.finish_reason = reason
        end = len(self.text) if reason is not None else len(self.text) - self._held()
        delta_text = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        p = self.params
        comp = CompletionOutput(0, self.text[:self.sent], list(self.token_ids),
                                list(self.logprobs) if p.logprobs else None, reason,
                                list(self.top_logprobs) if p.top_logprobs else None,
                                self.stop_reason if reason == "stop" else None)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [comp], self.finished,
                             delta_text, new_ids, self.prompt_logits if self.finished else None,
                             d.num_preemptions)

    def _add_text(self, piece: str, match: bool = True) -> bool:
        """Append `piece`; True when that completes a stop string (only looked for when `match`), the
        text then cut there."""
        if not piece:
            return False
        if not self.stops or not match:
            self.text += piece
            return False
        # Only a match that ends in `piece` is new: it starts at most len(stop) - 1 characters before it.
        # (Per stop string, so that a shorter one that min_tokens let pass earlier is not found now.)
        before = len(self.text)
        self.text += piece
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.stop_reason = s
        cut = i + len(s) if self.params.include_stop_str_in_output else i
        assert cut >= self.sent, "a stop string cut text that was already sent"
        self.text = self.text[:cut]
        return True

    def _held(self) -> int:
        """How many characters at the end of the unsent text could still begin a stop string."""
        if not self.holds_back:
            return 0
        tail = self.text[max(self.sent, len(self.text) - self.longest_stop + 1):]
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0
