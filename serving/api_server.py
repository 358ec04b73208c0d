"""OpenAI-compatible HTTP server over `AsyncLLM`: `tp-overlap serve`.

    tp-overlap serve                                   # the built-in demo model on 127.0.0.1:8000
    tp-overlap serve --model /models/Llama-3.1-8B --tp 2 --api-key secret

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as SSE with `stream: true`),
GET /v1/models, POST /tokenize and /detokenize (vLLM's shapes), GET and HEAD /health, GET /metrics
(Prometheus), GET /version. Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid requests (never FastAPI's 422), 401 for
a missing or wrong API key, 404 for an unknown model or route, 500 when the engine fails a request.

Every choice of a request is one engine request; a client that goes away (or a cancelled handler) aborts
all of its choices, so their KV blocks are free before the engine's next step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from pydantic import BaseModel, ValidationError

from .args import DEBUG_HINT, CliError, engine_config_from_args
from .config import RequestError, SamplingParams
from .protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage,
                       ChatTokenLogprob, ChatTopLogprob, CompletionChoice, CompletionLogprobs, CompletionRequest,
                       CompletionResponse, CompletionStreamChoice, CompletionStreamResponse, DeltaMessage,
                       DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse, UsageInfo, VersionResponse, new_id)

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .metrics import ServerMetrics
    _MISSING_EXTRA: Optional[ImportError] = None
except ImportError as _e:   # the `serve` extra is not installed: the CLI parser still works, serving does not
    _MISSING_EXTRA = _e
    StreamingResponse = object

logger = logging.getLogger("tp_overlap.server")

# One request may not occupy more than this many engine sequences (prompts x n), so a single client
# cannot queue an unbounded amount of work.
MAX_CHOICES_PER_REQUEST = 256

_ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    500: {"model": ErrorResponse, "description": "the engine failed this request"},
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
                503: "service_unavailable_error"}


# The API's name of a SamplingParams field, where the two differ.
_API_PARAM = {"structured_output": "response_format"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _printable(text: Optional[str]) -> Optional[str]:
    # An error may quote what the client sent; text that cannot be encoded would fail the error response.
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> dict:
    message, param = _printable(message), _printable(param)
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"), param=param,
                     code=code if code is not None else status)
    return ErrorResponse(error=info).model_dump()


def internal_error_body(exc: BaseException) -> dict:
    """The 500 of an exception that no handler expected."""
    return error_body(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[Union[str, int]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _clean_loc(loc) -> list[str]:
    # pydantic names the union branch it tried in the location (`content.str`, `prompt.list[int]`); a
    # client wants the field it sent.
    out = []
    for x in loc:
        x = str(x)
        if x == "body" and not out:
            continue
        if x in _UNION_TAGS or "[" in x:
            continue
        out.append(x)
    return out


def _describe_validation_errors(errors) -> tuple[str, Optional[str]]:
    """(message, param) from pydantic / FastAPI errors, naming the field and what is wrong with it."""
    by_param: dict[Optional[str], dict] = {}
    for e in errors:
        param = ".".join(_clean_loc(e.get("loc", ()))) or None
        seen = by_param.get(param)
        # Of the errors one union field collects (one per branch), the validator's own message is the
        # one that explains the problem.
        if seen is None or (e.get("type") == "value_error" and seen.get("type") != "value_error"):
            by_param[param] = e
    # A union field fails once per branch: at the field itself (`"content": 5` is no string) and deeper
    # (inside the list branch). When a deeper error exists, it is the informative one.
    deeper = {p for p in by_param if p and any(q and q.startswith(p + ".") for q in by_param)}
    parts, first_param = [], None
    for param, e in by_param.items():
        if param in deeper:
            continue
        kind = e.get("type", "")
        if kind == "json_invalid":
            ctx = e.get("ctx") or {}
            msg = f"the request body is not valid JSON ({ctx.get('error', e.get('msg'))})"
            param = None
        elif kind == "extra_forbidden":
            msg = f"unsupported parameter '{param}': this server does not implement it"
        elif kind == "missing" and param is None:
            msg = "the request body is empty; send a JSON object"
        elif kind == "missing":
            msg = f"missing required parameter '{param}'"
        elif kind == "model_attributes_type" and param is None:
            msg = "the request body must be a JSON object"
        else:
            msg = e.get("msg", "invalid value").removeprefix("Value error, ")
            if param:
                msg = f"invalid value for '{param}': {msg}"
        if first_param is None:
            first_param = param
        if msg not in parts:
            parts.append(msg)
    if not parts:
        return "invalid request", None
    more = f" (and {len(parts) - 3} more errors)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, first_param


def _is_json_media_type(ctype: str) -> bool:
    media = ctype.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _unencodable_field(value: Any, path: tuple = ()) -> Optional[tuple[str, str]]:
    """(field path, offending text) of the first string in a parsed request that is not valid Unicode.

    JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer can encode; found here, they are
    a 400 naming the field instead of an encoding error deep in the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return ".".join(map(str, path)), value[e.start:e.end]
        return None
    if isinstance(value, BaseModel):
        items = ((k, getattr(value, k)) for k in type(value).model_fields)
    elif isinstance(value, dict):
        items = [(k, k) for k in value] + list(value.items())   # keys are text too
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        hit = _unencodable_field(v, (*path, k))
        if hit is not None:
            return hit
    return None


def check_encodable(req: BaseModel) -> None:
    hit = _unencodable_field(req)
    if hit is not None:
        param, bad = hit
        raise ApiError(400, f"invalid value for '{param}': the text is not valid Unicode (it holds the lone "
                            f"surrogate {bad.encode('unicode_escape').decode()}); send UTF-8 text", param=param)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tp-overlap")
    except PackageNotFoundError:   # running from a source tree that was never installed
        return "unknown"


@dataclass
class _Choice:
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
    prompt_logits: Any = None
    observed: bool = False
    request: Any = None   # the engine's ProcessedRequest, once _make_choices has processed it


class _EngineFailure(Exception):
    pass


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, also when the client disconnected
    or the handler was cancelled, so the iterator's cleanup (aborting engine requests) runs at once."""

    def __init__(self, content, response_id: str, **kw):
        super().__init__(content, **kw)
        self.response_id = response_id

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels the streams still open when --shutdown-timeout runs out. The request ends
            # here either way; one line in the log says so instead of a traceback per stream.
            logger.warning("stream %s was cut off by the server shutting down; its request is aborted",
                           self.response_id)
        finally:
            await self.body_iterator.aclose()


def _sse(payload: Union[str, dict]) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServer:
    """The routes and their state; `app` is the FastAPI application."""

    def __init__(self, engine, served_model_name: str, api_key: Optional[str] = None,
                 model_root: Optional[str] = None):
        self.engine = engine
        self.model_name = served_model_name
        self.model_root = model_root
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(served_model_name, self._stats)
        self.app = self._build_app()

    def _stats(self) -> Optional[dict]:
        try:
            return self.engine.stats()
        except Exception:   # a shut-down engine has no stats to read
            return None

    # ---- request plumbing ----------------------------------------------------------------------
    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        return list(self.tokenizer.encode(text)) if text else []

    def _encode_chat(self, text: str) -> list[int]:
        # Chat templates usually write the BOS token themselves; encoding with special tokens would then
        # add a second one. Keep the tokenizer's own prefix only when the template did not write it.
        with_special = list(self.tokenizer.encode(text))
        plain = list(self.tokenizer.encode(text, add_special_tokens=False))
        prefix = with_special[:len(with_special) - len(plain)]
        if prefix and plain[:len(prefix)] == prefix:
            return plain
        return with_special

    def _check_context(self, n_prompt: int, max_tokens: int, param: str) -> None:
        limit = self.max_model_len
        if n_prompt + max_tokens > limit:
            raise ApiError(400, f"this model's context is {limit} tokens (max_model_len) but the request needs "
                                f"{n_prompt + max_tokens}: {n_prompt} prompt tokens + {param}={max_tokens}; "
                                f"shorten the prompt or lower {param}", param=param, code="context_length_exceeded")

    def _make_choices(self, base_id: str, prompts: list[tuple[Optional[str], list[int]]], n: int,
                      params_kw: dict, seed: Optional[int]) -> list[_Choice]:
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
                    msg, param = _describe_validation_errors(e.errors())
                    raise ApiError(400, msg, param=param) from None
                idx = pi * n + j
                choices.append(_Choice(idx, f"{base_id}-{idx}", pi, ids, text, sp, now))
        for c in choices:
            # The engine's own checks (vocabulary, length, tokenizer needs, grammar) here, before any
            # stream starts and before anything reaches the engine-core process, so that a bad request
            # is a 400 and not an error halfway through an SSE stream.
            try:
                c.request = self.engine.process_request(c.prompt_ids, c.params)
            except RequestError as e:   # a sampling parameter, the same for every choice
                raise ApiError(400, str(e), param=_API_PARAM.get(e.param, e.param)) from None
            except (ValueError, TypeError) as e:
                where = f"prompt {c.prompt_index}: " if len(prompts) > 1 else ""
                raise ApiError(400, f"{where}{e}", param="prompt") from None
            except RuntimeError as e:
                raise ApiError(500, f"the engine cannot accept requests: {e}", code="engine_error") from None
        return choices

    async def _pump(self, c: _Choice, q: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(c.request, request_id=c.request_id):
                q.put_nowait((c, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait((c, e))

    async def _run(self, choices: list[_Choice], endpoint: str) -> AsyncIterator[tuple[_Choice, Any]]:
        """Outputs of all choices as they come. Closing or cancelling this iterator aborts what is left."""
        q: asyncio.Queue = asyncio.Queue()
        self.metrics.prompt_tokens.labels(self.model_name).inc(
            sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values()))
        tasks = [asyncio.create_task(self._pump(c, q)) for c in choices]
        remaining = len(choices)
        try:
            while remaining:
                c, out = await q.get()
                if isinstance(out, BaseException):
                    c.finish_reason = "error"
                    self._observe(c, endpoint)
                    raise _EngineFailure(str(out))
                now = time.monotonic()
                if out.delta_token_ids:
                    if c.first_token is None:
                        c.first_token = now
                    c.last_token = now
                comp = out.outputs[0]
                c.token_ids = list(comp.token_ids)
                c.logprobs = list(comp.logprobs or [])
                c.top_logprobs = list(comp.top_logprobs or [])
                c.text = comp.text
                if out.finished:
                    c.finish_reason = comp.finish_reason
                    c.prompt_logits = out.prompt_logits
                    remaining -= 1
                    self._observe(c, endpoint)
                yield c, out
        finally:
            for t in tasks:
                t.cancel()
            for c in choices:
                if c.finish_reason is None:
                    self.engine.abort(c.request_id)
                    c.finish_reason = "abort"
                    self._observe(c, endpoint)

    def _observe(self, c: _Choice, endpoint: str) -> None:
        if not c.observed:
            c.observed = True
            self.metrics.observe_sequence(endpoint, c.finish_reason, c.arrival, c.first_token, c.last_token,
                                          len(c.token_ids))

    async def _collect(self, choices: list[_Choice], endpoint: str, request: Request) -> None:
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
        if isinstance(exc, _EngineFailure):
            raise ApiError(500, f"the engine failed while generating: {exc}", code="engine_error")
        if exc is not None:
            raise exc

    def _usage(self, choices: list[_Choice]) -> UsageInfo:
        prompt = sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values())
        done = sum(len(c.token_ids) for c in choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def _token_str(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"token_id:{t}"

    def _token_bytes(self, t: int) -> Optional[list[int]]:
        return list(self.tokenizer.token_bytes(t)) if self.tokenizer is not None else None

    def _completion_logprobs(self, ids: list[int], lps: list[Optional[float]],
                             tops: list[Optional[list[tuple[int, float]]]], offset: int) -> CompletionLogprobs:
        """OpenAI's legacy shape: per token its text, log-probability, {text: logprob} of the `logprobs`
        most likely tokens plus the sampled one, and its offset in the text."""
        out = CompletionLogprobs()
        tops = list(tops) + [None] * (len(ids) - len(tops))   # (none asked for: an empty list)
        for t, lp, top in zip(ids, lps, tops):
            s = self._token_str(t)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            if lp is None:
                out.top_logprobs.append(None)
            else:
                # Tokens that decode alike share a key; the likelier one keeps it.
                alts: dict[str, float] = {}
                for alt, alt_lp in top or []:
                    alts.setdefault(self._token_str(alt), alt_lp)
                alts.setdefault(s, lp)
                out.top_logprobs.append(alts)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def _chat_logprobs(self, ids: list[int], lps: list[float],
                       tops: list[list[tuple[int, float]]]) -> ChatChoiceLogprobs:
        content = []
        for i, (t, lp) in enumerate(zip(ids, lps)):
            alts = [ChatTopLogprob(token=self._token_str(a), logprob=alp, bytes=self._token_bytes(a))
                    for a, alp in (tops[i] if i < len(tops) else [])]
            content.append(ChatTokenLogprob(token=self._token_str(t), logprob=lp, bytes=self._token_bytes(t),
                                            top_logprobs=alts))
        return ChatChoiceLogprobs(content=content)

    def _prompt_logprobs(self, c: _Choice, k: int) -> tuple[list[Optional[float]], list]:
        """The prompt tokens' log-probabilities (the first has none) and their top k alternatives."""
        import torch

        ids = c.prompt_ids
        if c.prompt_logits is None or len(ids) < 2:
            return [None] * len(ids), [None] * len(ids)
        lp = torch.log_softmax(c.prompt_logits[:len(ids) - 1].float(), dim=-1)
        nxt = torch.tensor(ids[1:])[:, None]
        tops: list = [None]
        if k:
            vals, idx = lp.topk(k, dim=-1)
            tops += [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops += [[] for _ in ids[1:]]
        return [None] + lp.gather(1, nxt)[:, 0].tolist(), tops

    def _stream(self, response_id: str, chunks, stream_options, usage_chunk) -> "_SSEResponse":
        """The SSE envelope both streaming endpoints share: chunks, the optional usage chunk, `[DONE]`.
        The status line goes out before the first chunk, so a failure mid-stream becomes an error event and
        `[DONE]`, here rather than in _ErrorBarrier, which knows no request. Every stream that ends early
        says so in the log with its response id (its choices' engine request ids are `<response id>-<i>`)."""
        include_usage = bool(stream_options and stream_options.include_usage)

        async def events():
            self.metrics.in_flight.labels(self.model_name).inc()
            sent, finished = 0, False
            try:
                async with contextlib.aclosing(chunks) as it:
                    async for chunk in it:
                        yield _sse(chunk)
                        sent += 1
                if include_usage:
                    yield _sse(usage_chunk())
                finished = True
                yield _sse("[DONE]")
            except _EngineFailure as e:
                logger.error("stream %s: the engine failed after %d chunks: %s", response_id, sent, e)
                yield _sse(error_body(500, f"the engine failed while generating: {e}", code="engine_error"))
                yield _sse("[DONE]")
            except Exception as e:
                logger.exception("stream %s: unexpected error after %d chunks", response_id, sent)
                yield _sse(internal_error_body(e))
                yield _sse("[DONE]")
            except BaseException:
                # Cancelled (Starlette saw the client disconnect, or the server stops): not an error of
                # the server's, but the stream did not end, and _run aborts its engine requests.
                if not finished:
                    logger.info("stream %s ended after %d chunks: the client disconnected or the server is "
                                "stopping; its engine requests are aborted", response_id, sent)
                raise
            finally:
                self.metrics.in_flight.labels(self.model_name).dec()

        return _SSEResponse(events(), response_id, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _complete(self, choices: list[_Choice], endpoint: str, request: Request) -> None:
        self.metrics.in_flight.labels(self.model_name).inc()
        try:
            await self._collect(choices, endpoint, request)
        finally:
            self.metrics.in_flight.labels(self.model_name).dec()

    # ---- routes --------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req.model)
        prompts: list[tuple[Optional[str], list[int]]] = []
        for p in req.prompts():
            prompts.append((p, self._encode(p)) if isinstance(p, str) else (None, list(p)))
        for i, (_, ids) in enumerate(prompts):
            if not ids:
                raise ApiError(400, f"prompt {i} is empty; at least one token is required", param="prompt")
            self._check_context(len(ids), req.max_tokens, "max_tokens")
        want_lp = req.logprobs is not None
        kw = dict(req.sampling_kwargs(), max_tokens=req.max_tokens, logprobs=want_lp,
                  top_logprobs=req.logprobs or 0, prompt_logits=req.echo and want_lp)
        base = new_id("cmpl")
        choices = self._make_choices(base, prompts, req.n, kw, req.seed)

        def echo_text(c: _Choice) -> str:
            if c.prompt_text is not None:
                return c.prompt_text
            return self.tokenizer.decode(c.prompt_ids) if self.tokenizer is not None else ""

        if req.stream:
            async def chunks():
                sent = {c.index: 0 for c in choices}
                offsets = {c.index: 0 for c in choices}
                async with contextlib.aclosing(self._run(choices, "completions")) as it:
                    if req.echo:
                        for c in choices:
                            text = echo_text(c)
                            offsets[c.index] = len(text)
                            yield CompletionStreamResponse(id=base, model=self.model_name, choices=[
                                CompletionStreamChoice(index=c.index, text=text)]).model_dump()
                    async for c, out in it:
                        new_ids = c.token_ids[sent[c.index]:]
                        finish = c.finish_reason if out.finished else None
                        if not (out.delta_text or finish or (want_lp and new_ids)):
                            continue
                        lp = None
                        if want_lp:
                            lp = self._completion_logprobs(new_ids, c.logprobs[sent[c.index]:],
                                                           c.top_logprobs[sent[c.index]:], offsets[c.index])
                        sent[c.index] = len(c.token_ids)
                        offsets[c.index] += len(out.delta_text)
                        yield CompletionStreamResponse(id=base, model=self.model_name, choices=[
                            CompletionStreamChoice(index=c.index, text=out.delta_text, logprobs=lp,
                                                   finish_reason=finish)]).model_dump()

            return self._stream(base, chunks(), req.stream_options, lambda: CompletionStreamResponse(
                id=base, model=self.model_name, choices=[], usage=self._usage(choices)).model_dump())

        await self._complete(choices, "completions", request)
        out_choices = []
        for c in choices:
            text, lp = c.text, None
            if req.echo:
                text = echo_text(c) + c.text
            if want_lp:
                if req.echo:
                    p_lps, p_tops = self._prompt_logprobs(c, req.logprobs)
                    lp = self._completion_logprobs(c.prompt_ids + c.token_ids, p_lps + c.logprobs,
                                                   p_tops + c.top_logprobs, 0)
                else:
                    lp = self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0)
            out_choices.append(CompletionChoice(index=c.index, text=text, logprobs=lp,
                                                finish_reason=c.finish_reason))
        return CompletionResponse(id=base, model=self.model_name, choices=out_choices, usage=self._usage(choices))

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self._check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template; use /v1/completions with "
                                "token ids", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = self._encode_chat(text)
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if requested is None:
            if len(ids) >= self.max_model_len:
                raise ApiError(400, f"the messages take {len(ids)} tokens but this model's context is "
                                    f"{self.max_model_len} tokens (max_model_len); no room is left for a reply",
                               param="messages", code="context_length_exceeded")
            max_tokens = self.max_model_len - len(ids)
        else:
            self._check_context(len(ids), requested, param)
            max_tokens = requested
        kw = dict(req.sampling_kwargs(), max_tokens=max_tokens, logprobs=req.logprobs,
                  top_logprobs=req.top_logprobs or 0)
        base = new_id("chatcmpl")
        choices = self._make_choices(base, [(None, ids)], req.n, kw, req.seed)

        if req.stream:
            async def chunks():
                sent = {c.index: 0 for c in choices}
                async with contextlib.aclosing(self._run(choices, "chat")) as it:
                    # OpenAI streams announce the role first, once per choice.
                    for c in choices:
                        yield ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                            ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                        ]).model_dump()
                    async for c, out in it:
                        new_ids = c.token_ids[sent[c.index]:]
                        finish = c.finish_reason if out.finished else None
                        if not (out.delta_text or finish or (req.logprobs and new_ids)):
                            continue
                        k = sent[c.index]
                        lp = self._chat_logprobs(new_ids, c.logprobs[k:], c.top_logprobs[k:]) if req.logprobs else None
                        sent[c.index] = len(c.token_ids)
                        delta = DeltaMessage(content=out.delta_text) if out.delta_text else DeltaMessage()
                        chunk = ChatCompletionStreamResponse(id=base, model=self.model_name, choices=[
                            ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                                       finish_reason=finish)]).model_dump()
                        # OpenAI leaves unset delta fields out rather than sending nulls.
                        chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
                        yield chunk

            return self._stream(base, chunks(), req.stream_options, lambda: ChatCompletionStreamResponse(
                id=base, model=self.model_name, choices=[], usage=self._usage(choices)).model_dump())

        await self._complete(choices, "chat", request)
        out_choices = [ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                            logprobs=(self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                                                      if req.logprobs else None),
                                            finish_reason=c.finish_reason) for c in choices]
        return ChatCompletionResponse(id=base, model=self.model_name, choices=out_choices, usage=self._usage(choices))

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self._check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param="prompt" if req.prompt is not None else "messages")
        if req.prompt is not None:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
        else:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except ValueError as e:
                raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
            if req.add_special_tokens is None:     # what /v1/chat/completions feeds the model
                ids = self._encode_chat(text)
            else:
                ids = list(self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        strs = [self._token_str(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
                           param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    # ---- app -----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        version = package_version()
        app = FastAPI(title="tp-overlap OpenAI-compatible server", version=version,
                      description="A subset of the OpenAI API over the tp-overlap engine.")
        server = self

        @app.exception_handler(RequestValidationError)
        async def _validation(request: Request, exc: RequestValidationError):
            ctype = request.headers.get("content-type")
            if not _is_json_media_type(ctype or "") and any(e.get("type") == "model_attributes_type"
                                                             for e in exc.errors()):
                # FastAPI reads a body as JSON only under a JSON content type (recent versions: only when
                # the header is there); otherwise it arrives as raw bytes, which would read as "not an
                # object" to a client that did send a JSON object.
                sent = f"sent as '{ctype}'" if ctype else "sent without a Content-Type header"
                return error_response(400, f"the request body was {sent}; send it as JSON with the header "
                                           f"'Content-Type: application/json'")
            msg, param = _describe_validation_errors(exc.errors())
            return error_response(400, msg, param)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError):
            return error_response(exc.status, exc.message, exc.param, exc.code)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            return error_response(exc.status_code, str(exc.detail))

        @app.exception_handler(Exception)
        async def _internal(request: Request, exc: Exception):
            logger.exception("unhandled error on %s", request.url.path)
            return JSONResponse(internal_error_body(exc), status_code=500)

        @app.post("/v1/completions", response_model=CompletionResponse, responses={
            **_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}})
        async def completions(req: CompletionRequest, request: Request):
            check_encodable(req)
            return await server.completions(req, request)

        @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
            **_ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}})
        async def chat_completions(req: ChatCompletionRequest, request: Request):
            check_encodable(req)
            return await server.chat_completions(req, request)

        @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
        async def tokenize(req: TokenizeRequest):
            check_encodable(req)
            return server.tokenize(req)

        @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
        async def detokenize(req: DetokenizeRequest):
            return server.detokenize(req)

        @app.get("/v1/models", response_model=ModelList, responses={401: _ERROR_RESPONSES[401]})
        async def models():
            return ModelList(data=[ModelCard(id=server.model_name, root=server.model_root,
                                             max_model_len=server.max_model_len)])

        @app.get("/health", responses={503: {"description": "the engine is dead"}})
        async def health():
            if server.engine.alive():
                return Response(status_code=200)
            return error_response(503, "the engine is not running; restart the server")

        # Its own route, not methods=["GET", "HEAD"]: the OpenAPI schema wants one operation id per method.
        app.head("/health", responses={503: {"description": "the engine is dead"}})(health)

        @app.get("/metrics", response_class=Response)
        async def metrics():
            return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/version", response_model=VersionResponse)
        async def version_route():
            return VersionResponse(version=version)

        inner = _ApiKeyGuard(app, self.api_key) if self.api_key else app
        wrapped = _ResponseCounter(_ErrorBarrier(inner), server.metrics)
        # Route tables and the OpenAPI schema stay reachable on the FastAPI object.
        wrapped.fastapi = app
        return wrapped


class _ErrorBarrier:
    """ASGI middleware: an exception no handler turned into a response ends here, as a JSON 500 in OpenAI's
    shape, or, once a stream has started, as an error event that closes the stream.

    Starlette re-raises an exception after its handler has sent the 500, and uvicorn then drops the
    connection without `Connection: close`, so a keep-alive client's next request fails with a reset. This
    middleware keeps the exception from reaching uvicorn, and the connection stays usable."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "done": False, "sse": False}

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if state["done"]:
                return      # the exception handler answered (and logged) already
            logger.error("unhandled error on %s", scope.get("path"), exc_info=exc)
            body = internal_error_body(exc)
            with contextlib.suppress(Exception):   # the client may be gone
                if not state["started"]:
                    await JSONResponse(body, status_code=500)(scope, receive, send)
                elif state["sse"]:
                    await send({"type": "http.response.body", "body": (_sse(body) + _sse("[DONE]")).encode(),
                                "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ApiKeyGuard:
    """ASGI middleware: /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`. Checked before
    the body is parsed, so an unauthenticated client learns nothing about its request. /health, /metrics
    and /version stay open."""

    GUARDED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.GUARDED):
            auth = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    auth = v
            if not hmac.compare_digest(auth, self.expected):
                msg = "missing API key" if not auth else "invalid API key"
                resp = error_response(401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ResponseCounter:
    """ASGI middleware counting responses by route and status for /metrics."""

    _ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
               "/metrics", "/version"}

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self._ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)

    def __getattr__(self, name):
        return getattr(self.app, name)


def build_app(engine, served_model_name: str, api_key: Optional[str] = None, model_root: Optional[str] = None):
    """The ASGI app for an AsyncLLM (the FastAPI object is its `.fastapi`)."""
    return OpenAIServer(engine, served_model_name, api_key, model_root).app


# ---- command line ---------------------------------------------------------------------------------
def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    # Read from the environment at start, not as the option's default: --help would print the key.
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(default: $TP_OVERLAP_API_KEY, else none)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and uvicorn's log level")
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")


def serve_main(a: argparse.Namespace) -> int:
    if _MISSING_EXTRA is not None:
        raise CliError(f"the server needs the serve extra: {_MISSING_EXTRA}", hint="pip install 'tp-overlap[serve]'")
    import uvicorn

    from .config import env_rank_world
    from .engine.async_llm import AsyncLLM

    logging.basicConfig(level=getattr(logging, a.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = engine_config_from_args(a)
    t0 = time.perf_counter()

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum} during start-up")

    launched = env_rank_world()
    if launched is not None and launched[0] != 0:
        # A torchrun worker rank serves rank 0's steps inside the engine constructor. torchrun forwards
        # Ctrl-C / SIGTERM to every rank; this one must not die mid-collective but wait for rank 0, which
        # gets the same signal, to finish its requests and send the stop. (torchrun escalates to SIGKILL
        # if rank 0 never does.)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("rank %d: signal %d; waiting for rank 0 to stop",
                                                                 launched[0], signum))
        AsyncLLM(cfg)
        return 0
    # Until uvicorn takes over the signals, a SIGTERM must unwind the engine start (which then stops the
    # workers it spawned) instead of killing this process and orphaning them.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine = AsyncLLM(cfg)
    except Exception as e:
        # Nothing is served without an engine: exit with the reason, not a server that answers 503.
        raise CliError(f"the engine did not start: {e}", hint=DEBUG_HINT, status=1) from e
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not engine.is_driver:      # a torchrun worker rank: it served rank 0's steps until shutdown
        return 0
    try:
        name = a.served_model_name or cfg.model
        app = build_app(engine, name, a.api_key or os.environ.get("TP_OVERLAP_API_KEY"), model_root=cfg.model)
        logger.info("engine ready in %.1f s: model %s, tp=%d, max_model_len=%d, %d KV blocks of %d tokens",
                    time.perf_counter() - t0, cfg.model, cfg.tensor_parallel_size, engine.max_model_len,
                    engine.num_blocks, cfg.block_size)
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=not a.no_access_log,
                                timeout_graceful_shutdown=a.shutdown_timeout, lifespan="off")
        # uvicorn handles SIGINT/SIGTERM: stop accepting, let in-flight requests finish (or cancel them after
        # --shutdown-timeout, which aborts them in the engine); the engine and its workers stop below.
        # Afterwards uvicorn re-raises the signal under the handlers it found; with the defaults that would
        # kill this process before the engine is shut down, so those handlers only log.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("signal %d handled; stopping the engine", signum))
        try:
            uvicorn.Server(config).run()
        except SystemExit as e:      # uvicorn exits this way when it cannot bind, after logging why
            if e.code:
                raise CliError(f"the server could not listen on {a.host}:{a.port} (uvicorn exited with {e.code}; "
                               f"its reason is logged above)", hint="choose another --port, or stop what uses it",
                               status=1) from None
            raise
    finally:
        engine.shutdown()
        logger.info("engine shut down")
    return 0
