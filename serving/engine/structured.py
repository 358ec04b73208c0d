"""Structured output: JSON grammars through xgrammar, one token bitmask per step for the whole batch.

A request's `StructuredOutput` is compiled once (xgrammar caches compiled grammars) into a matcher
that the sequence carries. Each step the engine asks `fill` for a bitmask [B, ceil(V/32)] of the
constrained rows, which the sampler applies on the device in one op; the host accepts each sampled
token into its matcher before the sequence's next mask is built (engine/core.py says how under async
scheduling). Once the JSON is complete the grammar allows only the end-of-sequence tokens, so the
output ends there.

Both kinds are compiled without free whitespace (compact JSON, `", "` and `": "` separators): a model
that may put whitespace anywhere can also put it there forever.

Every finished output must parse and validate against its schema, so two gaps of xgrammar's schema
converter (0.2.8, and its main branch of 2026-08) are closed here:
- A string with minLength/maxLength becomes a bounded repetition of `[^"\\\r\n]`: raw control characters
  pass, which JSON forbids, and no escape can be written (mlc-ai/xgrammar#800). `_json_schema_grammar`
  replaces that repeated character with one JSON string character.
- Some keywords it ignores, with a log line only (`not`, `uniqueItems`, a length beside a `pattern`, ...):
  an output could then break them. Such a schema is refused, naming the keyword and where it is."""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional, Sequence

import torch

from ..config import StructuredOutput

# xgrammar's errors start with "[time] /path/to/file.cc:line: "; the rest is for the client.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _clean_error(e: Exception) -> str:
    msg = str(e).strip()
    return _XGR_PREFIX.sub("", msg).strip() or type(e).__name__


# How xgrammar prints the repeated character of a length-bounded string (module docstring).
_UNESCAPED_CHARACTER = r'[^\"\\\r\n]'
# One character of a JSON string, as maxLength counts them (code points of the decoded string): a code
# point other than `"`, `\`, the controls U+0000-U+001F and the surrogates (their UTF-8 is invalid, and
# decodes to three U+FFFD); a short escape; or \uXXXX of a code point outside the surrogates (a pair of
# them would be one character spelled as two escapes).
_JSON_CHARACTER_RULE = (r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" [\"\\/bfnrt]) | ("\\u" (([0-9A-Ca-c] '
                        r'[0-9A-Fa-f]{3}) | ([Dd] [0-7] [0-9A-Fa-f]{2}) | ([EeFf] [0-9A-Fa-f]{3}))))')
# The printed grammar's tokens: a quoted literal (also a Regex's argument), a character class, the rest.
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[^"\[]+', re.DOTALL)
_ESCAPE = re.compile(r'\\(x[0-9A-Fa-f]{2}|.)', re.DOTALL)


def _reparsable(token: str) -> str:
    # The printer writes U+0080-U+00FF as \xHH, and the parser reads \x with every hex digit that follows:
    # "é1" would come back as U+0E91. \u00HH has the fixed length that reads back right.
    return _ESCAPE.sub(lambda m: "\\u00" + m.group(1)[1:] if m.group(1)[0] == "x" else m.group(0), token)


@functools.lru_cache(maxsize=256)
def _json_schema_grammar(schema_json: str) -> Optional[str]:
    """The schema's grammar as EBNF with every length-bounded string's character made a JSON string
    character (module docstring); None when the schema has no such string, and xgrammar's own grammar
    is right as it is. (Cached: the conversion takes milliseconds, a compiled grammar's lookup less.)"""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False))
    if _UNESCAPED_CHARACTER not in ebnf:
        return None
    rule = "json_string_character"
    while re.search(rf"\b{rule}\b", ebnf):
        rule += "_"
    out = []
    for m in _EBNF_TOKEN.finditer(ebnf):
        token = m.group(0)
        if token == _UNESCAPED_CHARACTER:
            token = rule
        elif token[0] in '"[':
            token = _reparsable(token)
        out.append(token)
    return "".join(out) + f"\n{rule} ::= {_JSON_CHARACTER_RULE}\n"


# Keywords xgrammar's converter ignores: an output that follows the grammar may break them.
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "uniqueItems",
                     "contains", "minContains", "maxContains")
# Keywords whose value is a schema, a list of schemas, or a name -> schema map (the places to look further).
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_honoured(schema: Any, where: str = "schema") -> None:
    """ValueError naming the first keyword of `schema` the grammar would not enforce, and where it is."""
    if not isinstance(schema, dict):
        return
    for k in _IGNORED_KEYWORDS:
        if k in schema:
            raise ValueError(f"{where}.{k}: the keyword {k!r} is not supported in structured output")
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if lengths and ("pattern" in schema or "format" in schema):
        if "pattern" in schema:
            raise ValueError(f"{where}: {lengths[0]} together with 'pattern' is not supported in structured "
                             f"output; put the length into the pattern (e.g. ^[a-z]{{0,5}}$)")
        raise ValueError(f"{where}: {lengths[0]} together with 'format' is not supported in structured output")
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise ValueError(f"{where}.multipleOf: multipleOf of a non-integer is not supported in structured output")
    if "multipleOf" in schema and any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                             "exclusiveMaximum")):
        raise ValueError(f"{where}.multipleOf: multipleOf together with a range is not supported in "
                         f"structured output")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"{where}.allOf: an allOf of more than one schema is not supported in structured output")
    for k in _SUBSCHEMA:
        check_honoured(schema.get(k), f"{where}.{k}")
    for k in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(k), list):
            for i, sub in enumerate(schema[k]):
                check_honoured(sub, f"{where}.{k}[{i}]")
    for k in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            for name, sub in schema[k].items():
                check_honoured(sub, f"{where}.{k}.{name}")


class StructuredOutputs:
    """Grammar compiler and batch bitmask filler for one engine's vocabulary.

    The front end builds it over its tokenizer: it compiles (to reject a bad schema before anything
    runs) and describes the vocabulary for the core (`vocabulary_json`). The engine core has no
    tokenizer (tokenizer=None): it compiles against the vocabulary the front end sent
    (`receive_vocabulary`), keeps the matchers and fills the masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._vocabulary: Optional[str] = None   # TokenizerInfo.serialize_json(), the core's
        self._info = None
        self._compiler = None
        self._batch = None

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:
            raise ValueError("structured output needs the xgrammar package (pip install 'tp-overlap[serve]')") from e
        return xgrammar

    @property
    def compiler(self):
        if self._compiler is None:
            xgr = self._xgr()
            self._info = self._tokenizer_info(xgr)
            self._compiler = xgr.GrammarCompiler(self._info)
        return self._compiler

    def vocabulary_json(self) -> str:
        """The vocabulary as xgrammar describes it (its stop ids included), for `receive_vocabulary`."""
        self.compiler  # noqa: B018 (builds the info)
        return self._info.serialize_json()

    def receive_vocabulary(self, info_json: str) -> None:
        """The front end's `vocabulary_json`: what a compiler without a tokenizer compiles against."""
        self._vocabulary = info_json

    def _tokenizer_info(self, xgr):
        if self.tokenizer is None:
            if self._vocabulary is not None:
                return xgr.TokenizerInfo.deserialize_json(self._vocabulary)
            # (the core's: the front end sends the vocabulary before the first grammar it needs)
            raise ValueError("structured output needs a tokenizer; this model has none")
        hf = getattr(self.tokenizer, "hf_tokenizer", None)
        if hf is not None:
            return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        vocab = getattr(self.tokenizer, "encoded_vocab", None)
        if vocab is None:
            raise ValueError(f"structured output is not supported with {type(self.tokenizer).__name__}")
        # Token strings as raw bytes; "" marks a special token, which no grammar ever allows (its
        # text is not what it decodes to); ids past the tokenizer's vocabulary are special too.
        return xgr.TokenizerInfo(vocab(), xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids)

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar; ValueError naming the problem when the schema is not usable."""
        compiler = self.compiler
        if so.json_object or so.json_schema is not None:
            return self._compile_json(compiler, so)
        # vLLM's other kinds (guided_regex, guided_choice, guided_grammar): the text, not JSON.
        try:
            if so.regex is not None:
                return compiler.compile_regex(so.regex)
            if so.choice is not None:
                # One string literal per choice; JSON's escapes are also EBNF's.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                          for c in so.choice))
            return compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            kind = "regex" if so.regex is not None else "choice" if so.choice is not None else "grammar"
            raise ValueError(f"the {kind} cannot be used: {_clean_error(e)}") from None

    def _compile_json(self, compiler, so: StructuredOutput) -> Any:
        try:
            if so.json_object:
                return compiler.compile_json_schema({"type": "object"}, any_whitespace=False)
            check_honoured(so.json_schema)
            schema_json = json.dumps(so.json_schema)   # (key order matters: it is the output's)
            ebnf = _json_schema_grammar(schema_json)
            if ebnf is None:
                return compiler.compile_json_schema(schema_json, any_whitespace=False)
            return compiler.compile_grammar(ebnf)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"the JSON schema cannot be used: {_clean_error(e)}") from None

    def matcher(self, compiled) -> Any:
        """A matcher of `compiled`; it ends on the stop ids of the vocabulary the grammar was compiled
        against. Made where the masks are filled (the core's step loop), before any fill."""
        xgr = self._xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()   # threads: half the cores
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: Sequence[Any], rows: Sequence[int], batch_size: int,
             device: torch.device) -> torch.Tensor:
        """The bitmask [batch_size, ceil(V/32)] on `device`: rows[i] from matchers[i], other rows all
        ones. A fresh host tensor each step, so that no copy still in flight reads a row being refilled."""
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(list(matchers), mask, indices=list(rows))
        return mask.to(device)

