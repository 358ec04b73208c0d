"""Tokenizers: the built-in byte-level one (demo model) and HF tokenizers from a model directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; a handful of specials follow. Needs no files.

    Ids past that (a shipped config run with dummy weights has a 128k vocabulary but no tokenizer
    files) decode to a visible placeholder `<|t123|>`, so every generated token shows as text and
    a stream carries a chunk per token, as it would with the model's real tokenizer."""

    SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

    def __init__(self):
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.eos_token_id = self.special_ids["<|eos|>"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = [self.bos_token_id] if add_special_tokens else []
        # Specials written literally in the text (e.g. by the chat template) map to their ids.
        i = 0
        while i < len(text):
            if text[i] == "<":
                hit = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
                if hit:
                    ids.append(self.special_ids[hit])
                    i += len(hit)
                    continue
            j = text.find("<", i + 1)
            j = len(text) if j < 0 else j
            ids.extend(text[i:j].encode("utf-8"))
            i = j
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if t >= self.vocab_size:
                out.append(f"<|t{t}|>")
            elif not skip_special_tokens:
                out.append(self.SPECIALS[t - 256])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for (a piece of a UTF-8 character stays a piece)."""
        if token_id < 256:
            return bytes([token_id])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def encoded_vocab(self) -> list:
        """Each id's bytes, "" for the specials (their text is not what they stand for)."""
        return [bytes([i]) for i in range(256)] + [""] * len(self.SPECIALS)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, continue_final_message: bool = False,
                            chat_template: Optional[str] = None, **template_kwargs) -> str:
        """A request's own Jinja `chat_template` when given (chat_template.py); else the built-in format,
        `<|role|>content<|end|>` per message. Tools, when offered, are a system turn of their own first;
        an assistant's tool calls follow its content as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
        blocks, and a tool's result is a user turn in `<tool_response>` tags, as Qwen2.5's template writes
        them: so the demo pairs with `--tool-call-parser hermes`. continue_final_message leaves the last turn
        open; like a Jinja template, it ignores variables it does not use."""
        if chat_template is not None:
            from .chat_template import render_chat_template

            specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
            return render_chat_template(chat_template, messages, add_generation_prompt, tools,
                                        continue_final_message, specials, **template_kwargs)
        parts = []
        if tools:
            listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            parts.append(f"<|system|># Tools\n<tools>\n{listed}\n</tools>\nTo call a function, reply with "
                         f'<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call><|end|>')
        for m in messages:
            role = m.get("role")
            if role == "tool":
                parts.append(f"<|user|><tool_response>\n{m.get('content') or ''}\n</tool_response><|end|>")
                continue
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"unknown chat role {role!r}")
            text = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                text += "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                                                   ensure_ascii=False) + "</tool_call>"
            parts.append(f"<|{role}|>{text}<|end|>")
        if continue_final_message:
            parts[-1] = parts[-1].removesuffix("<|end|>")
        elif add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


class HFTokenizer:
    """Thin adapter so the engine sees one tokenizer shape."""

    def __init__(self, path: Path):
        try:
            from transformers import AutoTokenizer
            self._tok = AutoTokenizer.from_pretrained(str(path))
            self._hf = True
        except ImportError:
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            self._hf = False
        self.eos_token_id = getattr(self._tok, "eos_token_id", None) if self._hf else None
        self._byte_decoder: Optional[dict[str, int]] = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer, or None when only the `tokenizers` library was available."""
        return self._tok if self._hf else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this one token stands for: exact for byte-level BPE (GPT-2, Llama 3, Qwen) and for
        sentencepiece byte fallback (<0x..>); otherwise the UTF-8 of its decoded text."""
        if self._byte_decoder is None:
            self._byte_decoder = _byte_level_decoder(self._tok) or {}
        piece = (self._tok.convert_ids_to_tokens(token_id) if self._hf else self._tok.id_to_token(token_id)) or ""
        if self._byte_decoder and all(ch in self._byte_decoder for ch in piece):
            return bytes(self._byte_decoder[ch] for ch in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, continue_final_message: bool = False,
                            chat_template: Optional[str] = None, **template_kwargs) -> str:
        if chat_template is not None:
            if not self._hf:
                raise ValueError("a request's chat_template needs the transformers library on the server")
            template_kwargs["chat_template"] = chat_template   # (transformers renders it in its sandbox)
        elif not self._hf or not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        # tools=None, not [], without tools: some templates write a tools section for any list.
        return self._tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)


def _byte_level_decoder(tok) -> Optional[dict[str, int]]:
    """Byte-level BPE writes each byte as one printable character (printable Latin-1 bytes as
    themselves, the rest shifted past 255); the inverse of that table, if `tok` decodes that way."""
    backend = getattr(tok, "backend_tokenizer", tok)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def load_tokenizer(model_dir: Optional[Path], tokenizer_dir: Optional[str] = None):
    """The byte tokenizer for the demo model; otherwise the model dir's tokenizer, or None if it has none."""
    if tokenizer_dir is not None:
        return HFTokenizer(Path(tokenizer_dir))
    if model_dir is None:
        return ByteTokenizer()
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return HFTokenizer(model_dir)
    return None


class IncrementalDetokenizer:
    """Turns output tokens into text deltas whose concatenation, once `flush()` has run, is exactly
    the tokenizer's decode of the output ids (read in the context of the prompt's last tokens).

    A delta is only emitted when it cannot change later: text ending in U+FFFD may be a character
    whose remaining bytes are still to come, so it waits for a token after which the text no longer
    ends that way, or for `flush()`. Decoding a window of the last few tokens, not all of them,
    keeps each push cheap on long outputs."""

    CONTEXT = 4

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens of context make sentencepiece-style leading spaces decode as they do
        # after the prompt. A context cut inside a character would merge with the output's first
        # bytes, so such a context is dropped.
        ctx = list(prompt_ids[-self.CONTEXT:])
        ctx_text = self._decode(ctx) if ctx else ""
        if ctx_text.endswith("\ufffd"):
            ctx, ctx_text = [], ""
        self.context, self.context_text = len(ctx), ctx_text
        self.ids: list[int] = ctx
        self.prefix = 0                   # the window being decoded starts here ...
        self.read = len(ctx)              # ... and its text up to here has been emitted (or is context)
        self.read_text = ctx_text         # decode(ids[prefix:read])
        self.text = ""                    # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        window = self._decode(self.ids[self.prefix:])
        if window.endswith("\ufffd") or not window.startswith(self.read_text):
            return ""
        delta = window[len(self.read_text):]
        if not delta:
            # (a special token the decode skips) The window stays: a sentencepiece decode drops the
            # leading space of a window's first token, which the next token would become.
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self.read_text = self._decode(self.ids[self.prefix:])
        self.text += delta
        return delta

    def final_text(self) -> str:
        """The decode of all output ids after the context: what `text` is once flushed."""
        if self.context:
            full = self._decode(self.ids)
            if full.startswith(self.context_text):
                return full[len(self.context_text):]
        return self._decode(self.ids[self.context:])

    def flush(self) -> str:
        """What is still held back, once the output is over; afterwards `text == final_text()`."""
        final = self.final_text()
        if final.startswith(self.text):
            delta = final[len(self.text):]
        else:
            # Only a tokenizer whose decode rewrites text across token boundaries (clean-up of
            # spaces before punctuation) gets here: what was streamed cannot be taken back.
            window = self._decode(self.ids[self.prefix:])
            delta = window[len(self.read_text):] if window.startswith(self.read_text) else ""
        self.prefix = self.read = len(self.ids)
        self.read_text = ""
        self.text += delta
        return delta
