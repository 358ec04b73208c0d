"""POST /v1/chat/completions: the messages through the model's chat template, then one engine request per
choice."""

from __future__ import annotations

import contextlib
import logging

from fastapi import Request

from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage)
from .server_errors import ApiError
from .serving_base import OpenAIServing

logger = logging.getLogger("tp_overlap.server")


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        ignored = req.ignored_fields()
        if ignored:
            logger.debug("chat request: ignoring %s (they change nothing on this server)",
                         ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
        ids = self._chat_ids([m.for_template() for m in req.messages], req.add_generation_prompt,
                             req.continue_final_message, req.chat_template_kwargs)
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if requested is None:
            if len(ids) >= self.max_model_len:
                raise ApiError(400, f"the messages take {len(ids)} tokens but this model's context is "
                                    f"{self.max_model_len} tokens (max_model_len); no room is left for a reply",
                               param="messages", code="context_length_exceeded")
            max_tokens = self.max_model_len - len(ids)
        else:
            self._check_context(len(ids), requested, param, "messages")
            max_tokens = requested
        kw = dict(req.sampling_kwargs(), max_tokens=max_tokens, logprobs=req.logprobs,
                  top_logprobs=req.top_logprobs or 0, prompt_logits=req.prompt_logprobs is not None)
        base, engine_id = self._response_id("chatcmpl", req, request)
        choices = self._make_choices(engine_id, [(None, ids)], req.n, kw, req.seed, req.structured_param())
        echoed = req.echoed()

        if req.stream:
            async def chunks():
                sent = {c.index: 0 for c in choices}
                async with contextlib.aclosing(self._run(choices, "chat")) as it:
                    # OpenAI streams announce the role first, once per choice.
                    for c in choices:
                        yield ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                            ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                        ]).model_dump()
                        if echoed:
                            chunk = ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                                ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage())]).model_dump()
                            chunk["choices"][0]["delta"] = {"content": echoed}
                            yield chunk
                    async for c, text in it:
                        new_ids = c.token_ids[sent[c.index]:]
                        finish = c.finish_reason
                        if not (text or finish or (req.logprobs and new_ids)):
                            continue
                        k = sent[c.index]
                        lp = self.logprobs.chat(new_ids, c.logprobs[k:], c.top_logprobs[k:]) if req.logprobs else None
                        sent[c.index] = len(c.token_ids)
                        delta = DeltaMessage(content=text) if text else DeltaMessage()
                        chunk = ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                            ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                                       finish_reason=finish)]).model_dump()
                        # OpenAI leaves unset delta fields out rather than sending nulls.
                        chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
                        yield chunk

            return self._stream(base, chunks(), req.stream_options, lambda: ChatCompletionStreamResponse(
                id=base, model=self.model_name, choices=[], usage=self._usage(choices)).model_dump(), choices)

        await self._complete(choices, "chat", request)
        out_choices = [ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=echoed + c.text),
                                            logprobs=(self.logprobs.chat(c.token_ids, c.logprobs, c.top_logprobs)
                                                      if req.logprobs else None),
                                            finish_reason=c.finish_reason) for c in choices]
        plp = None if req.prompt_logprobs is None else \
            self.logprobs.prompt(ids, choices[0].prompt_logits, req.prompt_logprobs)
        return ChatCompletionResponse(id=base, model=self.model_name, choices=out_choices, usage=self._usage(choices),
                                      prompt_logprobs=plp)
