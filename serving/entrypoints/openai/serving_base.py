"""What the completions and chat handlers share (vLLM's `OpenAIServing`): the model check, prompt
encoding and context limits, one engine request per choice (`Choice`), running them with abort on
disconnect, and the SSE envelope of a stream.

Every choice of a request is one engine request; a client that goes away (or a cancelled handler) aborts
all of its choices, so their KV blocks are free before the engine's next step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ...config import ContextLengthError, RequestError, SamplingParams
from ...metrics import ServerMetrics
from .protocol import UsageInfo, new_id, sse
from .protocol_vllm import MAX_REQUEST_ID_CHARS
from .protocol_vllm_fields import truncated
from .server_errors import API_PARAM, ApiError, describe_validation_errors, error_body, internal_error_body
from .server_logprobs import LogprobFormatter
from .server_shutdown import InFlight

logger = logging.getLogger("tp_overlap.server")

# One request may not occupy more than this many engine sequences (prompts x n), so a single client
# cannot queue an unbounded amount of work.
MAX_CHOICES_PER_REQUEST = 256
try:
    from jinja2 import TemplateError as _JinjaError
except ImportError:   # no transformers, so no Jinja template either
    _JinjaError = TypeError
# What a template raises on the variables or messages a client sent.
_TEMPLATE_ERRORS = (TypeError, LookupError, ArithmeticError, _JinjaError)
# chat_template_kwargs keys that are the template call's own arguments, not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tokenize", "return_dict", "return_tensors",
                                      "add_generation_prompt", "continue_final_message", "chat_template",
                                      "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask", "tools"})
# Queued in place of an output: the choice was aborted by a server shutting down.
_ABORTED = object()


@dataclass
class Choice:
    """One engine request: choice `index` of the response."""

    index: int
    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: Optional[str]
    params: SamplingParams
    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: Any = None   # vLLM's: the matched stop string or stop token id, else None
    prompt_logits: Any = None
    observed: bool = False
    request: Any = None   # the engine's ProcessedRequest, once _make_choices has processed it


class EngineFailure(Exception):
    pass


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, also when the client disconnected
    or the handler was cancelled, so the iterator's cleanup (aborting engine requests) runs at once."""

    def __init__(self, content, response_id: str, **kw):
        super().__init__(content, **kw)
        self.response_id = response_id

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels the streams still open when it is told to leave without waiting (a third
            # signal). The request ends here either way; one line in the log says so, not a traceback.
            logger.warning("stream %s was cut off by the server shutting down; its request is aborted",
                           self.response_id)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    """The state every handler reads: the engine, the served model's name and limits, the metrics, the
    requests in flight."""

    def __init__(self, engine, model_name: str, metrics: ServerMetrics, in_flight: InFlight,
                 trust_request_chat_template: bool = False):
        self.engine = engine
        # vLLM's --trust-request-chat-template: a request's own Jinja template runs only when the operator
        # allows it (a template is code: it can loop for as long as it likes).
        self.trust_request_chat_template = trust_request_chat_template
        self.model_name = model_name
        self.metrics = metrics
        self.in_flight = in_flight
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self._logprobs_as_ids = LogprobFormatter(engine.tokenizer, as_token_ids=True)

    def logprob_formatter(self, req) -> LogprobFormatter:
        """The formatter of a request's logprobs: tokens as text, or as `token_id:<id>` when it asked."""
        return self._logprobs_as_ids if req.return_tokens_as_token_ids else self.logprobs

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    # Tokenization is the engine's (engine/input_processor.py); these turn its errors into 400s.
    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.engine.input_processor.encode(text, add_special_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]] = None,
                  continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
                  chat_template: Optional[str] = None, add_special_tokens: Optional[bool] = None) -> list[int]:
        """The ids /v1/chat/completions feeds the model for these messages (and tools)."""
        text = self._chat_text(messages, add_generation_prompt, tools, continue_final_message, template_kwargs,
                               chat_template)
        return self._chat_text_ids(text, add_special_tokens)

    def _chat_text_ids(self, text: str, add_special_tokens: Optional[bool]) -> list[int]:
        """A rendered chat's ids: with the tokenizer's special tokens (true), without (false), or (None) with
        its prefix only where the template did not write it."""
        if add_special_tokens is None:
            return self.engine.input_processor.encode_chat(text)
        return self._encode(text, add_special_tokens)

    def _truncate(self, ids: list[int], keep: Optional[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` ids."""
        try:
            return truncated(ids, keep, self.max_model_len)
        except ValueError as e:
            raise ApiError(400, str(e), param="truncate_prompt_tokens") from None

    def _chat_text(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list[dict]] = None,
                   continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
                   chat_template: Optional[str] = None) -> str:
        if chat_template is not None and not self.trust_request_chat_template:
            raise ApiError(400, "a chat_template was sent with the request, but this server runs only its model's "
                                "template: start it with --trust-request-chat-template to allow templates from "
                                "requests", param="chat_template")
        reserved = sorted(set(template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets "
                                f"{'it' if len(reserved) == 1 else 'them'} (add_generation_prompt, "
                                f"continue_final_message and tools are request fields)", param="chat_template_kwargs")
        try:
            return self.engine.input_processor.chat_text(messages, add_generation_prompt, tools,
                                                         continue_final_message, chat_template=chat_template,
                                                         **(template_kwargs or {}))
        except ValueError as e:
            raise ApiError(400, str(e), param="chat_template" if chat_template is not None else "messages") from None
        except _TEMPLATE_ERRORS as e:
            # A template that fails on a client's variable (chat_template_kwargs) is the request's fault.
            param = "chat_template" if chat_template is not None else \
                "chat_template_kwargs" if template_kwargs else "messages"
            raise ApiError(400, f"the chat template failed: {type(e).__name__}: {e}", param=param) from None

    def _check_context(self, n_prompt: int, max_tokens: Optional[int], param: str, prompt_param: str) -> None:
        """A 400 naming what to change when the prompt and `param`=max_tokens (None: the rest of the
        context) do not fit it: the input processor's check, its error as the API's."""
        try:
            self.engine.input_processor.check_context(n_prompt, max_tokens, param, prompt_param)
        except ContextLengthError as e:
            raise ApiError(400, str(e), param=e.param, code="context_length_exceeded") from None

    def _response_id(self, prefix: str, req, request: Request) -> tuple[str, str]:
        """(response id, prefix of its engine request ids). The response id is `<prefix>-<id>` with the
        X-Request-Id header's id, else the body's request_id (vLLM's order), else a fresh one. A client's
        id may repeat (also while a request with it runs), so its engine requests get a fresh suffix, as
        vLLM's internal ids do: the engine never sees an id twice."""
        rid = request.headers.get("x-request-id")
        if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID_CHARS and all("!" <= ch <= "~" for ch in rid)):
            raise ApiError(400, f"the X-Request-Id header must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII "
                                f"characters without spaces")
        rid = rid or req.request_id
        if rid is None:
            base = new_id(prefix)
            request.state.request_id = base
            return base, base
        request.state.request_id = rid
        return f"{prefix}-{rid}", new_id(f"{prefix}-{rid}")

    def _make_choices(self, engine_id: str, prompts: list[tuple[Optional[str], list[int]]], n: int,
                      params_kw: dict, seed: Optional[int], structured_param: str = "response_format") -> list[Choice]:
        if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
            raise ApiError(400, f"the request asks for {len(prompts)} prompts x n={n} = {len(prompts) * n} "
                                f"completions; at most {MAX_CHOICES_PER_REQUEST} per request", param="n")
        now = time.monotonic()
        choices = []
        for pi, (text, ids) in enumerate(prompts):
            for j in range(n):
                kw = dict(params_kw)
                if seed is not None:
                    # Distinct but reproducible streams for the n samples of one seeded request.
                    kw["seed"] = seed + j
                try:
                    sp = SamplingParams(**kw)
                except ValidationError as e:
                    msg, param = describe_validation_errors(e.errors())
                    raise ApiError(400, msg, param=param) from None
                idx = pi * n + j
                choices.append(Choice(idx, f"{engine_id}-{idx}", pi, ids, text, sp, now))
        for c in choices:
            # The engine's own checks (vocabulary, length, tokenizer needs, grammar) here, before any
            # stream starts and before anything reaches the engine-core process, so that a bad request
            # is a 400 and not an error halfway through an SSE stream.
            try:
                c.request = self.engine.process_request(c.prompt_ids, c.params)
            except RequestError as e:   # a sampling parameter, the same for every choice
                param = structured_param if e.param == "structured_output" else API_PARAM.get(e.param, e.param)
                raise ApiError(400, str(e), param=param) from None
            except (ValueError, TypeError) as e:
                where = f"prompt {c.prompt_index}: " if len(prompts) > 1 else ""
                raise ApiError(400, f"{where}{e}", param="prompt") from None
            except RuntimeError as e:
                raise ApiError(500, f"the engine cannot accept requests: {e}", code="engine_error") from None
        return choices

    async def _pump(self, c: Choice, q: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(c.request, request_id=c.request_id):
                q.put_nowait((c, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait((c, e))

    async def _run(self, choices: list[Choice], endpoint: str) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) of all choices as their outputs come; a choice's last one has its
        `finish_reason` set. Closing or cancelling this iterator aborts what is left. A server shutting
        down (`InFlight.abort_all`) ends the unfinished choices with finish_reason "abort"."""
        q: asyncio.Queue = asyncio.Queue()
        self.metrics.observe_prompt(sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values()))
        tasks = [asyncio.create_task(self._pump(c, q)) for c in choices]

        def abort():
            # Cancelling a pump ends its engine stream, which aborts the engine request (once it was
            # sent: no abort can overtake its request); the marker ends the choice here.
            for c, t in zip(choices, tasks):
                if not t.done():
                    t.cancel()
                    q.put_nowait((c, _ABORTED))

        unregister = self.in_flight.register(abort)
        remaining = len(choices)
        try:
            while remaining:
                c, out = await q.get()
                if out is _ABORTED:
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                        remaining -= 1
                        self._observe(c, endpoint)
                        yield c, ""
                    continue
                if isinstance(out, BaseException):
                    c.finish_reason = "error"
                    self._observe(c, endpoint)
                    raise EngineFailure(str(out))
                now = time.monotonic()
                if out.delta_token_ids:
                    if c.first_token is None:
                        c.first_token = now
                    else:
                        self.metrics.observe_tokens(now - c.last_token, len(out.delta_token_ids))
                    c.last_token = now
                comp = out.outputs[0]
                c.token_ids = list(comp.token_ids)
                c.logprobs = list(comp.logprobs or [])
                c.top_logprobs = list(comp.top_logprobs or [])
                c.text = comp.text
                if out.finished:
                    c.finish_reason = comp.finish_reason
                    c.stop_reason = comp.stop_reason
                    c.prompt_logits = out.prompt_logits
                    remaining -= 1
                    self._observe(c, endpoint)
                yield c, out.delta_text
        finally:
            unregister()
            for t in tasks:
                t.cancel()
            for c in choices:
                if c.finish_reason is None:
                    self.engine.abort(c.request_id)
                    c.finish_reason = "abort"
                    self._observe(c, endpoint)

    def _observe(self, c: Choice, endpoint: str) -> None:
        if not c.observed:
            c.observed = True
            self.metrics.observe_sequence(endpoint, c.finish_reason, c.arrival, c.first_token, c.last_token,
                                          len(c.token_ids), len(c.prompt_ids))

    async def _collect(self, choices: list[Choice], endpoint: str, request: Request) -> None:
        """Run to completion; a client that disconnects meanwhile cancels (and so aborts) the request."""

        async def consume():
            async with contextlib.aclosing(self._run(choices, endpoint)) as it:
                async for _ in it:
                    pass

        async def disconnected():
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            raise ApiError(499, "the client disconnected")
        exc = work.exception()
        if isinstance(exc, EngineFailure):
            raise ApiError(500, f"the engine failed while generating: {exc}", code="engine_error")
        if exc is not None:
            raise exc

    def _usage(self, choices: list[Choice]) -> UsageInfo:
        prompt = sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values())
        done = sum(len(c.token_ids) for c in choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def _stream(self, response_id: str, chunks, stream_options, usage_chunk, choices: list[Choice] = ()
                ) -> "SSEResponse":
        """The chat and completion streams: chunks, the optional usage chunk, `[DONE]`; a failure mid-stream is
        an error event and `[DONE]` (the shared envelope, _sse). Their choices' engine request ids are
        `<response id>-<i>`, or `<response id>-<suffix>-<i>` when the client chose the id."""
        include_usage = bool(stream_options and stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        continuous = include_usage and stream_options.continuous_usage_stats

        async def frames():
            async with contextlib.aclosing(chunks) as it:
                async for chunk in it:
                    if continuous:
                        chunk["usage"] = self._usage(choices).model_dump()
                    yield sse(chunk)
            if include_usage:
                yield sse(usage_chunk())
            yield sse("[DONE]")

        def failed(e: Exception) -> list[str]:
            body = (error_body(500, f"the engine failed while generating: {e}", code="engine_error")
                    if isinstance(e, EngineFailure) else internal_error_body(e))
            return [sse(body), sse("[DONE]")]
        return self._sse(response_id, frames(), failed)

    def _sse(self, response_id: str, frames: AsyncIterator[str], failed) -> "SSEResponse":
        """The SSE envelope every streaming route shares: `frames` (SSE-encoded) counted in flight. The status
        line goes out before the first frame, so a failure mid-stream becomes the route's own failure frames
        (`failed(exception)`), here rather than in _ErrorBarrier, which knows no request; a stream that ends
        early says so in the log with its response id."""

        async def body():
            self.metrics.in_flight.labels(self.model_name).inc()
            sent, finished = 0, False
            try:
                async with contextlib.aclosing(frames) as it:
                    async for frame in it:
                        yield frame
                        sent += 1
                finished = True
            except Exception as e:
                if isinstance(e, EngineFailure):
                    logger.error("stream %s: the engine failed after %d events: %s", response_id, sent, e)
                else:
                    logger.exception("stream %s: unexpected error after %d events", response_id, sent)
                for frame in failed(e):
                    yield frame
            except BaseException:
                # Cancelled (Starlette saw the client disconnect, or the server stops): not an error of
                # the server's, but the stream did not end, and _run aborts its engine requests.
                if not finished:
                    logger.info("stream %s ended after %d events: the client disconnected or the server is "
                                "stopping; its engine requests are aborted", response_id, sent)
                raise
            finally:
                self.metrics.in_flight.labels(self.model_name).dec()

        return SSEResponse(body(), response_id, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _complete(self, choices: list[Choice], endpoint: str, request: Request) -> None:
        self.metrics.in_flight.labels(self.model_name).inc()
        try:
            await self._collect(choices, endpoint, request)
        finally:
            self.metrics.in_flight.labels(self.model_name).dec()
