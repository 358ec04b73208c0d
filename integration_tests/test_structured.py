"""Structured output's grammars (serving/engine/structured.py), without a model: random walks through the token
masks that the engine applies, over schemas that hypothesis generates (bounded strings, enums, nested
objects, arrays, anyOf, patterns). Every walk that the grammar ends must parse as JSON and validate against
its schema with `jsonschema`. Two vocabularies: the demo's bytes, and bytes plus multi-byte tokens that
span JSON punctuation and split UTF-8 characters. (test_server_openai.py runs the same property through the
server and the demo model.)"""

import json
import random

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tp_overlap_plugin.serving.config import StructuredOutput  # noqa: E402
from tp_overlap_plugin.serving.engine.structured import StructuredOutputs  # noqa: E402
from tp_overlap_plugin.serving.model.tokenizer import ByteTokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _MergedTokens(ByteTokenizer):
    """The byte tokenizer plus tokens of several bytes: JSON punctuation runs, escapes, a whole and a split
    UTF-8 character (é is c3 a9), a continuation byte glued to a quote."""

    MERGED = [b'"}', b'", "', b'": "', b'"]', b"\\n", b"\\u00", b'\\"', b"ab", b"\xc3\xa9", b"\xa9\"", b"\x80\x80",
              b"0.", b"true", b"null", b"}, {", b"\x12a"]

    def encoded_vocab(self):
        return super().encoded_vocab() + list(self.MERGED)

    def token_bytes(self, t):
        return self.MERGED[t - self.vocab_size] if t >= self.vocab_size else super().token_bytes(t)


def _structured(tokenizer, vocab_size):
    return StructuredOutputs(tokenizer, vocab_size, [tokenizer.eos_token_id])


BYTES = ByteTokenizer()
MERGED = _MergedTokens()
VOCABS = {"bytes": (BYTES, BYTES.vocab_size), "merged": (MERGED, MERGED.vocab_size + len(MERGED.MERGED))}
_CLOSING = set(b'"}],0123456789')


def _walk(so: StructuredOutputs, compiled, tokenizer, vocab_size: int, rng: random.Random, budget: int = 300):
    """A random output the grammar allows: the text once the grammar ended it, None if `budget` tokens ran
    out first. Half the draws prefer tokens that close something, so that most walks end."""
    matcher = so.matcher(compiled)
    eos = tokenizer.eos_token_id
    out = b""
    for _ in range(budget):
        mask = so.fill([matcher], [0], 1, torch.device("cpu"))[0]
        bits = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
        allowed = bits.nonzero()[:, 0].tolist()
        assert allowed, f"the grammar allows no token after {out!r}"
        closing = [t for t in allowed if t == eos or (t != eos and tokenizer.token_bytes(t)[-1:] and
                                                       tokenizer.token_bytes(t)[-1] in _CLOSING)]
        t = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert matcher.accept_token(t), f"the grammar refused token {t} that its mask allowed, after {out!r}"
        if t == eos:
            return out.decode("utf-8", "replace")   # what the detokenizer makes of the bytes
        out += tokenizer.token_bytes(t)
    return None


def _check_walks(schema: dict, vocab: str, seeds: range) -> int:
    tokenizer, vocab_size = VOCABS[vocab]
    so = _structured(tokenizer, vocab_size)
    compiled = so.compile(StructuredOutput(json_schema=schema))
    finished = 0
    for seed in seeds:
        text = _walk(so, compiled, tokenizer, vocab_size, random.Random(seed))
        if text is None:
            continue
        finished += 1
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not JSON ({e}): {text!r} for {json.dumps(schema)}") from None
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{text!r} breaks {json.dumps(schema)}: {e.message}") from None
    return finished


# ---- the schemas: bounded strings, enums, numbers, nested objects, arrays, anyOf, patterns ---------------
def _string(lo, hi):
    s = {"type": "string"}
    if lo is not None:
        s["minLength"] = lo
    if hi is not None:
        s["maxLength"] = max(hi, lo or 0)
    return s


def _integer(lo, span):
    return {"type": "integer"} if lo is None else {"type": "integer", "minimum": lo, "maximum": lo + span}


_JSON_SCALARS = st.one_of(st.text(max_size=4), st.integers(-20, 20), st.booleans(), st.none())
_LEAVES = st.one_of(
    st.builds(_string, st.none() | st.integers(0, 3), st.none() | st.integers(0, 6)),
    st.builds(_integer, st.none() | st.integers(-40, 40), st.integers(0, 500)),
    st.just({"type": "number"}), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(_JSON_SCALARS, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]+-[A-Z]?$", "^.{0,3}$"]).map(lambda p: {"type": "string", "pattern": p}),
)
_NAMES = st.text(alphabet='abxy_é"\\', min_size=1, max_size=3)


def _object(props: dict, data) -> dict:
    required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _array(items, lo, extra):
    return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra}


def _composite(children):
    return st.one_of(
        st.builds(_array, children, st.integers(0, 2), st.integers(0, 3)),
        st.lists(children, min_size=2, max_size=2).map(lambda c: {"anyOf": c}),
        st.tuples(st.dictionaries(_NAMES, children, min_size=1, max_size=3), st.data()).map(lambda t: _object(*t)),
    )


_SCHEMAS = st.recursive(_LEAVES, _composite, max_leaves=6)
TOP = st.tuples(st.dictionaries(_NAMES, _SCHEMAS, min_size=1, max_size=4), st.data()).map(lambda t: _object(*t))


@pytest.mark.parametrize("vocab", sorted(VOCABS))
@settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(schema=TOP)
def test_every_finished_output_parses_and_validates(schema, vocab):
    _check_walks(schema, vocab, range(3))


@pytest.mark.parametrize("vocab", sorted(VOCABS))
def test_bounded_strings_escape_and_never_hold_raw_controls(vocab):
    """The schema of issue 40 (raw control characters came out of the bounded string), walked many times;
    and a bounded string can still hold every JSON escape, each one character of maxLength."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"]}
    assert _check_walks(schema, vocab, range(60)) >= 40
    tokenizer, vocab_size = VOCABS[vocab]
    so = _structured(tokenizer, vocab_size)
    compiled = so.compile(StructuredOutput(json_schema=schema))

    def accepts(text: bytes) -> bool:
        m = so.matcher(compiled)
        return all(m.accept_token(b) for b in text) and m.accept_token(tokenizer.eos_token_id)

    assert accepts(b'{"a": 1, "b": "\\"\\\\\\/\\n\\u00e9"}')           # 5 characters, all escaped
    assert not accepts(b'{"a": 1, "b": "\\n\\n\\n\\n\\n\\n"}')           # 6
    assert not accepts(b'{"a": 1, "b": "x\x12"}') and not accepts(b'{"a": 1, "b": "\t"}')
    assert not accepts(b'{"a": 1, "b": "\\ud800"}')                      # a lone surrogate
    assert not accepts(b'{"a": 1, "b": "\xed\xa0\x80"}')                 # a surrogate's (invalid) UTF-8
    assert accepts('{"a": 1, "b": "éé\U0001F600ab"}'.encode())            # code points, not bytes


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3, "pattern": "^a+$"}}},
     "schema.properties.s: maxLength together with 'pattern'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "schema.uniqueItems"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "schema.anyOf[1].not"),
    ({"type": "number", "multipleOf": 0.5}, "schema.multipleOf"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "schema.allOf"),
])
def test_keywords_the_grammar_would_not_enforce_are_refused_by_name(schema, fragment):
    so = _structured(BYTES, BYTES.vocab_size)
    with pytest.raises(ValueError, match="not supported in structured output") as e:
        so.compile(StructuredOutput(json_schema=schema))
    assert fragment in str(e.value)


# ---- forced tool calls (serving/entrypoints/openai/chat_tools.py): grammars built from the tools' parameters ----
TOOL_PARAMETERS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
     "required": ["city", "days"]},
    {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "tags": {"type": "array", "items": {
        "type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2}}, "required": ["unit"]},
    None,   # a function without parameters: its arguments are {}
]


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_parse_and_validate_against_their_function(parallel):
    """tool_choice 'required' and a named function: every output the grammar ends is calls that the reply
    parser reads back, each naming one of the tools, its arguments valid for that tool."""
    from tp_overlap_plugin.serving.entrypoints.openai.chat_tools import plan_tools
    from tp_overlap_plugin.serving.entrypoints.openai.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": f"f{i}", **({"parameters": p} if p else {})}}
             for i, p in enumerate(TOOL_PARAMETERS)]
    so = _structured(BYTES, BYTES.vocab_size)
    for choice in ("required", {"type": "function", "function": {"name": "f1"}}):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                    "tool_choice": choice, "parallel_tool_calls": parallel})
        plan = plan_tools(req, None)
        compiled = so.compile(StructuredOutput(json_schema=plan.structured_output["json_schema"]))
        seen, finished = set(), 0
        for seed in range(20):
            text = _walk(so, compiled, BYTES, BYTES.vocab_size, random.Random(seed))
            if text is None:
                continue
            finished += 1
            calls = plan.parser.snapshot(text, final=True).calls
            assert calls and (parallel or len(calls) == 1), text
            for c in calls:
                params = TOOL_PARAMETERS[int(c.name[1:])] or {"type": "object", "additionalProperties": False}
                jsonschema.validate(json.loads(c.arguments), params)
                seen.add(c.name)
        assert finished >= 10 and (seen == {"f0", "f1", "f2"} if choice == "required" else seen == {"f1"}), seen
