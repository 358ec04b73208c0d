"""POST /v1/completions (OpenAI's legacy completions API, with vLLM's extensions)."""

from __future__ import annotations

import contextlib
from typing import Optional

from fastapi import Request

from .protocol import (CompletionChoice, CompletionRequest, CompletionResponse, CompletionStreamChoice,
                       CompletionStreamResponse)
from .server_errors import ApiError
from .server_logprobs import prompt_logprobs
from .serving_base import Choice, OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        prompts: list[tuple[Optional[str], list[int]]] = []
        add_special = req.add_special_tokens is not False
        for p in req.prompts():
            text, ids = (p, self._encode(p, add_special)) if isinstance(p, str) else (None, list(p))
            kept = self._truncate(ids, req.truncate_prompt_tokens)
            # A truncated prompt's text is no longer what the model saw: echo decodes what it kept.
            prompts.append((text if len(kept) == len(ids) else None, kept))
        for i, (_, ids) in enumerate(prompts):
            if not ids:
                raise ApiError(400, f"prompt {i} is empty; at least one token is required", param="prompt")
            self._check_context(len(ids), req.max_tokens, "max_tokens", "prompt")
        # vLLM's max_tokens null: what the longest prompt leaves of the context.
        max_tokens = req.max_tokens if req.max_tokens is not None else \
            self.max_model_len - max(len(ids) for _, ids in prompts)
        lpf = self.logprob_formatter(req)
        want_lp = req.logprobs is not None
        # best_of > n: best_of candidates per prompt, the n with the highest cumulative logprob returned.
        n_gen = max(req.n, req.best_of or 0)
        kw = dict(req.sampling_kwargs(), max_tokens=max_tokens, logprobs=want_lp or n_gen > req.n,
                  top_logprobs=req.logprobs or 0,
                  prompt_logits=(req.echo and want_lp) or req.prompt_logprobs is not None)
        base, engine_id = self._response_id("cmpl", req, request)
        choices = self._make_choices(engine_id, prompts, n_gen, kw, req.seed, req.structured_param())

        def echo_text(c: Choice) -> str:
            if c.prompt_text is not None:
                return c.prompt_text
            return self.tokenizer.decode(c.prompt_ids) if self.tokenizer is not None else ""

        if req.stream:
            async def chunks():
                sent = {c.index: 0 for c in choices}
                offsets = {c.index: lpf.offsets() for c in choices}
                async with contextlib.aclosing(self._run(choices, "completions")) as it:
                    if req.echo:
                        for c in choices:
                            text = echo_text(c)
                            offsets[c.index] = lpf.offsets(len(text))
                            yield CompletionStreamResponse(id=base, model=self.model_name, choices=[
                                CompletionStreamChoice(index=c.index, text=text)]).model_dump()
                    async for c, text in it:
                        new_ids = c.token_ids[sent[c.index]:]
                        finish = c.finish_reason
                        if not (text or finish or (want_lp and new_ids)):
                            continue
                        lp = None
                        if want_lp:
                            lp = lpf.completion(new_ids, c.logprobs[sent[c.index]:],
                                                           c.top_logprobs[sent[c.index]:], offsets[c.index])
                        sent[c.index] = len(c.token_ids)
                        yield CompletionStreamResponse(id=base, model=self.model_name, choices=[
                            CompletionStreamChoice(index=c.index, text=text, logprobs=lp, finish_reason=finish,
                                                   stop_reason=c.stop_reason if finish else None)]).model_dump()

            return self._stream(base, chunks(), req.stream_options, lambda: CompletionStreamResponse(
                id=base, model=self.model_name, choices=[], usage=self._usage(choices)).model_dump(), choices)

        await self._complete(choices, "completions", request)
        out_choices = []
        for index, c in enumerate(_best(choices, len(prompts), n_gen, req.n)):
            text, lp = c.text, None
            if req.echo:
                text = echo_text(c) + c.text
            if want_lp:
                if req.echo:
                    p_lps, p_tops = prompt_logprobs(c.prompt_ids, c.prompt_logits, req.logprobs)
                    lp = lpf.completion(c.prompt_ids + c.token_ids, p_lps + c.logprobs, p_tops + c.top_logprobs,
                                        lpf.offsets())
                else:
                    lp = lpf.completion(c.token_ids, c.logprobs, c.top_logprobs, lpf.offsets())
            plp = None if req.prompt_logprobs is None else \
                self.logprobs.prompt(c.prompt_ids, c.prompt_logits, req.prompt_logprobs)
            out_choices.append(CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason, prompt_logprobs=plp))
        return CompletionResponse(id=base, model=self.model_name, choices=out_choices, usage=self._usage(choices))


def _best(choices: list[Choice], n_prompts: int, n_gen: int, n: int) -> list[Choice]:
    """Per prompt, the n of its n_gen candidates with the highest cumulative log-probability (vLLM's
    best_of), best first; all of them, in order, when n_gen == n."""
    if n_gen == n:
        return choices
    out = []
    for pi in range(n_prompts):
        group = choices[pi * n_gen:(pi + 1) * n_gen]
        out += sorted(group, key=lambda c: sum(c.logprobs), reverse=True)[:n]
    return out
