"""POST /v1/chat/completions: the messages (and tools) through the model's chat template, then one engine
request per choice; tool calls out of the replies (chat_tools.py, tool_parsers.py)."""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

from fastapi import Request

from .chat_tools import finish_reason, plan_tools, reply_message
from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, DeltaMessage)
from .server_errors import ApiError
from .serving_base import OpenAIServing
from .tool_parsers import ToolCallStream

logger = logging.getLogger("tp_overlap.server")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *shared, tool_parser: Optional[str] = None, trust_request_chat_template: bool = False):
        super().__init__(*shared, trust_request_chat_template=trust_request_chat_template)
        # The --tool-call-parser that tool_choice 'auto' uses; None: --enable-auto-tool-choice is off.
        self.tool_parser = tool_parser

    async def create(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        ignored = req.ignored_fields()
        if ignored:
            logger.debug("chat request: ignoring %s (they change nothing on this server)",
                         ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
        plan = plan_tools(req, self.tool_parser)
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.documents is not None:
            template_kwargs["documents"] = req.documents
        ids = self._chat_ids([m.for_template() for m in req.messages], req.add_generation_prompt,
                             plan.template_tools, req.continue_final_message, template_kwargs or None,
                             req.chat_template, req.add_special_tokens)
        ids = self._truncate(ids, req.truncate_prompt_tokens)
        lpf = self.logprob_formatter(req)
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self._check_context(len(ids), requested, param, "messages")
        max_tokens = self.max_model_len - len(ids) if requested is None else requested
        kw = dict(req.sampling_kwargs(), max_tokens=max_tokens, logprobs=bool(req.logprobs),
                  top_logprobs=req.top_logprobs or 0, prompt_logits=req.prompt_logprobs is not None)
        if plan.forced:
            kw["structured_output"] = plan.structured_output
        base, engine_id = self._response_id("chatcmpl", req, request)
        try:
            choices = self._make_choices(engine_id, [(None, ids)], req.n, kw, req.seed, req.structured_param())
        except ApiError as e:
            if plan.forced and e.param == "response_format":   # the grammar made of the tools' parameters
                raise ApiError(400, f"the tools' parameters cannot be forced: {e.message}", param="tools") from None
            raise
        echoed = req.echoed()

        if req.stream:
            async def chunks():
                sent = {c.index: 0 for c in choices}
                calls = {c.index: ToolCallStream(plan.parser, plan.max_calls) for c in choices} if plan.parser else {}
                texts = {c.index: "" for c in choices}
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
                        tool_deltas = []
                        if plan.parser:
                            texts[c.index] += text
                            text, tool_deltas = calls[c.index].push(text, final=finish is not None)
                            finish = finish_reason(plan, calls[c.index].called, texts[c.index], finish)
                        if not (text or tool_deltas or finish or (req.logprobs and new_ids)):
                            continue
                        k = sent[c.index]
                        lp = lpf.chat(new_ids, c.logprobs[k:], c.top_logprobs[k:]) if req.logprobs else None
                        sent[c.index] = len(c.token_ids)
                        delta = DeltaMessage(content=text or None, tool_calls=tool_deltas or None)
                        chunk = ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                            ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish,
                                                       stop_reason=c.stop_reason if finish else None)]).model_dump()
                        # OpenAI leaves unset delta fields out rather than sending nulls.
                        chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
                        yield chunk

            return self._stream(base, chunks(), req.stream_options, lambda: ChatCompletionStreamResponse(
                id=base, model=self.model_name, choices=[], usage=self._usage(choices)).model_dump(), choices)

        await self._complete(choices, "chat", request)
        out_choices = []
        for c in choices:
            message, called = reply_message(plan, c.text)
            if echoed:   # (as the stream sends it: the echo first, whatever follows)
                message.content = echoed + (message.content or "")
            out_choices.append(ChatCompletionChoice(
                index=c.index, message=message, finish_reason=finish_reason(plan, called, c.text, c.finish_reason),
                stop_reason=c.stop_reason,
                logprobs=lpf.chat(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None))
        plp = None if req.prompt_logprobs is None else \
            self.logprobs.prompt(ids, choices[0].prompt_logits, req.prompt_logprobs)
        return ChatCompletionResponse(id=base, model=self.model_name, choices=out_choices, usage=self._usage(choices),
                                      prompt_logprobs=plp)
