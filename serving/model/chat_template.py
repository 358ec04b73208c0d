"""A Jinja chat template sent with a request (vLLM's `chat_template` field), rendered for the built-in byte
tokenizer (Hugging Face tokenizers render their own: transformers' apply_chat_template).

Rendered as transformers renders templates: in Jinja's immutable sandbox (a template cannot reach Python
objects' internals or change the messages), with trailing newlines kept and blocks trimmed, and with the
variables templates expect: messages, tools, add_generation_prompt, the special tokens, `raise_exception`,
plus the request's chat_template_kwargs. A template is code all the same (it may loop long): the server
runs one only with --trust-request-chat-template."""

from __future__ import annotations

import functools
import json
from typing import Any, Optional


class TemplateRaised(ValueError):
    """A template's own `raise_exception(message)`."""


def _raise(message: str):
    raise TemplateRaised(message)


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False) -> str:
    # Templates print tool schemas with it; Jinja's own tojson escapes HTML characters, which JSON in a
    # prompt must keep as they are.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool,
                         tools: Optional[list[dict]], continue_final_message: bool, special_tokens: dict[str, str],
                         **template_kwargs) -> str:
    """The template's text for these messages. continue_final_message cuts the text after the last
    message's content, so the reply continues it; ValueError when the content is not in the text."""
    text = _compile(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **special_tokens, **template_kwargs)
    if continue_final_message:
        last = messages[-1].get("content") or ""
        at = text.rfind(last.strip()) if last.strip() else -1
        if at < 0:
            raise ValueError("continue_final_message: the chat template's text does not contain the last "
                             "message's content, so the reply cannot continue it")
        text = text[:at + len(last.strip())]
    return text
