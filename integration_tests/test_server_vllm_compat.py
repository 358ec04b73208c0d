"""A drop-in for vLLM's clients (issue 54), black-box on one demo server started as a vLLM user starts
`vllm serve`: VLLM_API_KEY set, --trust-request-chat-template, and a small --max-request-body-bytes so that
the 413 is cheap to reach. Unknown fields are ignored (logged once by name), vLLM's defaults are a 200, what
cannot be honoured is a 400 naming the field; truncate_prompt_tokens, bad_words, allowed_token_ids,
return_tokens_as_token_ids, add_special_tokens, chat_template, documents, cache_salt and stop_reason as vLLM
fills them; the request token histograms; the body limit.

The demo's byte tokenizer makes token ids checkable: a byte is its own id, the specials are 256.. (256 BOS)."""

import json
import os
import re
import types

import httpx
import openai
import pytest

from serving_helpers import ServerProcess

pytestmark = pytest.mark.timeout(180)

MAX_LEN = 128
KEY = "vllm-style-key"
BODY_LIMIT = 64 * 1024
BOS = 256
USER = [{"role": "user", "content": "Say something"}]

# vLLM's chat and completion request fields at their defaults (vllm/entrypoints/openai/*/protocol.py), as a
# client that builds whole vLLM request objects sends them.
VLLM_COMMON_DEFAULTS = dict(
    frequency_penalty=0.0, logit_bias=None, n=1, presence_penalty=0.0, seed=None, stop=[], stream=False,
    stream_options=None, temperature=None, top_p=None, user=None, use_beam_search=False, top_k=None, min_p=None,
    repetition_penalty=None, length_penalty=1.0, stop_token_ids=[], include_stop_str_in_output=False,
    ignore_eos=False, min_tokens=0, skip_special_tokens=True, spaces_between_special_tokens=True,
    truncate_prompt_tokens=None, prompt_logprobs=None, allowed_token_ids=None, response_format=None,
    structured_outputs=None, priority=0, logits_processors=None, return_tokens_as_token_ids=None,
    return_token_ids=None, cache_salt=None, kv_transfer_params=None, vllm_xargs=None,
    max_repetition_pattern_size=0, min_repetition_pattern_size=0, repetition_min_count=0,
    # older vLLM's guided decoding fields
    guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None, structural_tag=None,
    guided_decoding_backend=None, guided_whitespace_pattern=None)
VLLM_CHAT_DEFAULTS = dict(
    VLLM_COMMON_DEFAULTS, logprobs=False, top_logprobs=0, max_tokens=None, max_completion_tokens=None, tools=None,
    tool_choice="none", reasoning_effort=None, include_reasoning=True, parallel_tool_calls=True, bad_words=[],
    echo=False, add_generation_prompt=True, continue_final_message=False, add_special_tokens=False,
    documents=None, chat_template=None, chat_template_kwargs=None, mm_processor_kwargs=None)
VLLM_COMPLETION_DEFAULTS = dict(
    VLLM_COMMON_DEFAULTS, echo=False, logprobs=None, max_tokens=16, suffix=None, prompt_embeds=None,
    add_special_tokens=True)


@pytest.fixture(scope="module")
def server():
    env = {k: v for k, v in os.environ.items() if k != "TP_OVERLAP_API_KEY"}
    env["VLLM_API_KEY"] = KEY
    with ServerProcess(["--max-model-len", str(MAX_LEN), "--no-access-log", "--log-level", "warning",
                        "--trust-request-chat-template", "--max-request-body-bytes", str(BODY_LIMIT)],
                       env=env) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, status: int, param, *fragments) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(f in err["message"] for f in fragments), err
    return err


def _ids(logprob_tokens) -> list[int]:
    """The ids of `token_id:<id>` strings (return_tokens_as_token_ids)."""
    out = []
    for t in logprob_tokens:
        m = re.fullmatch(r"token_id:(\d+)", t)
        assert m, t
        out.append(int(m.group(1)))
    return out


def test_vllm_api_key_locks_the_server(server, http):
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    _ok(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
    assert httpx.get(server.url + "/health").status_code == 200   # (open, as before)


def test_unknown_fields_and_vllm_defaults_are_200(server, http):
    plain = _ok(http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 8, "temperature": 0}))
    for _ in range(2):
        full = _ok(http.post("/v1/completions", json={**VLLM_COMPLETION_DEFAULTS, "prompt": "Once", "max_tokens": 8,
                                                      "temperature": 0, "foo": None, "x_unknown_knob": None}))
        assert full["choices"][0]["text"] == plain["choices"][0]["text"] and full["usage"] == plain["usage"]
    chat = _ok(http.post("/v1/chat/completions", json={**VLLM_CHAT_DEFAULTS, "messages": USER, "max_tokens": 8,
                                                       "foo": None}))
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    # unknown fields of nested objects too (a message's, structured_outputs')
    msgs = [{"role": "user", "content": "hi", "foo": None}]
    _ok(http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "structured_outputs":
                                                {"choice": ["a", "b"], "foo": None, "disable_fallback": True}}))
    log = server.log_tail(400)
    assert len(re.findall(r" CompletionRequest: ignoring the unknown fields? .*'foo'", log)) == 1, log
    assert "'x_unknown_knob'" in log


REFUSED = [
    ({"priority": 1}, "priority", "priority scheduling is not enabled"),
    ({"use_beam_search": True}, "use_beam_search", "beam search is not implemented"),
    ({"logits_processors": ["my.Processor"]}, "logits_processors", "no logits processors"),
    ({"return_token_ids": True}, "return_token_ids", "not returned"),
    ({"guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern", "compact"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "compact"),
    ({"max_repetition_pattern_size": 4}, "max_repetition_pattern_size", "repeated patterns"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "no prompt"),
    ({"truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens", "max_model_len"),
    ({"allowed_token_ids": [1, 10 ** 6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", None),
    ({"bad_words": [""]}, "bad_words.0", None),
    ({"cache_salt": ""}, "cache_salt", None),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds", "not supported"),
]


@pytest.mark.parametrize("extra,param,fragment", REFUSED, ids=[p for _, p, _ in REFUSED])
def test_what_cannot_be_honoured_is_a_400_naming_it(http, extra, param, fragment):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    _error(r, 400, param, *([fragment] if fragment else []))


def test_neutral_values_are_accepted(http):
    so = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
          "disable_any_whitespace": True, "disable_additional_properties": True}
    r = _ok(http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 30, "temperature": 0, "priority": 0, "spaces_between_special_tokens": False,
        "guided_decoding_backend": "xgrammar", "use_beam_search": False, "logits_processors": [],
        "length_penalty": 0.5, "structured_outputs": so}))
    choice = r["choices"][0]
    if choice["finish_reason"] == "stop":
        text = choice["message"]["content"]
        assert isinstance(json.loads(text)["a"], int) and " " not in text, text


def test_truncate_prompt_tokens_sets_the_prompt_length(http):
    prompt = "The quick brown fox jumps over the lazy dog"
    for keep in (5, 12):
        r = _ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "truncate_prompt_tokens": keep,
                                                   "echo": True}))
        assert r["usage"]["prompt_tokens"] == keep
        assert r["choices"][0]["text"].startswith(prompt[-keep:])   # echo: the prompt the model saw
    r = _ok(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "truncate_prompt_tokens": 7}))
    assert r["usage"]["prompt_tokens"] == 7
    # -1: the model's context; a prompt that fits is kept whole
    whole = _ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))["usage"]["prompt_tokens"]
    r = _ok(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": -1}))
    assert r["usage"]["prompt_tokens"] == whole


def test_allowed_token_ids_and_bad_words(http):
    allowed = sorted(ord(c) for c in "abc ")
    for seed in range(3):
        r = _ok(http.post("/v1/completions", json={
            "prompt": "Once", "max_tokens": 24, "temperature": 1.0, "seed": seed, "ignore_eos": True, "n": 2,
            "allowed_token_ids": allowed, "logprobs": 1, "return_tokens_as_token_ids": True}))
        for c in r["choices"]:
            ids = _ids(c["logprobs"]["tokens"])
            assert len(ids) == 24 and set(ids) <= set(allowed), ids
            assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
        # bad_words: never "ab", never "c" (a one-token word), whatever else is allowed
        r = _ok(http.post("/v1/completions", json={
            "prompt": "Once", "max_tokens": 32, "temperature": 1.0, "seed": seed, "ignore_eos": True, "n": 2,
            "allowed_token_ids": allowed, "bad_words": ["ab", "c"]}))
        for c in r["choices"]:
            assert "ab" not in c["text"] and "c" not in c["text"] and len(c["text"]) == 32, c["text"]
    r = _ok(http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 16, "temperature": 1.0, "seed": 3, "ignore_eos": True,
        "allowed_token_ids": allowed, "bad_words": ["ba"], "logprobs": True, "return_tokens_as_token_ids": True}))
    content = r["choices"][0]["logprobs"]["content"]
    assert set(_ids(t["token"] for t in content)) <= set(allowed)
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    assert "ba" not in r["choices"][0]["message"]["content"]


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _stop_cases(text: str, ids: list[int]) -> list[tuple[dict, object]]:
    """A stop string and a stop token id from the middle of a greedy reply, each with its stop_reason."""
    stop_str, stop_id = text[5:8], ids[3]
    assert len(stop_str) == 3, text
    return [({"stop": [stop_str, "never-there"]}, stop_str), ({"stop_token_ids": [stop_id]}, stop_id)]


def test_stop_reason_as_vllm_fills_it(http):
    base = {"prompt": "Once upon", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = _ok(http.post("/v1/completions", json={**base, "logprobs": 0, "return_tokens_as_token_ids": True}))
    assert ref["choices"][0]["stop_reason"] is None and ref["choices"][0]["finish_reason"] == "length"
    for extra, expected in _stop_cases(ref["choices"][0]["text"], _ids(ref["choices"][0]["logprobs"]["tokens"])):
        r = _ok(http.post("/v1/completions", json={**base, **extra}))
        assert (r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"]) == ("stop", expected), r
        chunks = _sse(http.post("/v1/completions", json={**base, **extra, "stream": True}))
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [expected]
    chat = {"messages": USER, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = _ok(http.post("/v1/chat/completions", json={**chat, "logprobs": True, "return_tokens_as_token_ids": True}))
    assert ref["choices"][0]["stop_reason"] is None and ref["choices"][0]["finish_reason"] == "length"
    content = ref["choices"][0]["message"]["content"]
    for extra, expected in _stop_cases(content, _ids(t["token"] for t in ref["choices"][0]["logprobs"]["content"])):
        got = _ok(http.post("/v1/chat/completions", json={**chat, **extra}))["choices"][0]
        assert (got["finish_reason"], got["stop_reason"]) == ("stop", expected), got
        chunks = _sse(http.post("/v1/chat/completions", json={**chat, **extra, "stream": True}))
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [expected]


def test_add_special_tokens(http):
    def prompt_tokens(path, body):
        return _ok(http.post(path, json={**body, "max_tokens": 1}))["usage"]["prompt_tokens"]

    comp = {"prompt": "Hello"}
    assert prompt_tokens("/v1/completions", comp) == len("Hello") + 1   # BOS
    assert prompt_tokens("/v1/completions", {**comp, "add_special_tokens": False}) == len("Hello")
    chat = {"messages": USER}
    plain = _ok(http.post("/tokenize", json={**chat, "add_special_tokens": False}))["tokens"]
    assert plain[0] != BOS
    assert prompt_tokens("/v1/chat/completions", {**chat, "add_special_tokens": False}) == len(plain)
    assert prompt_tokens("/v1/chat/completions", {**chat, "add_special_tokens": True}) == len(plain) + 1


TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
            "{% for d in documents or [] %}(doc {{ d.title }}){% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_request_chat_template_and_documents(http):
    body = {"messages": USER, "chat_template": TEMPLATE, "add_special_tokens": False}
    tok = _ok(http.post("/tokenize", json={**body, "return_token_strs": True}))
    assert bytes(tok["tokens"]).decode() == "[user]Say something\n[assistant]"
    r = _ok(http.post("/v1/chat/completions", json={**body, "max_tokens": 2}))
    assert r["usage"]["prompt_tokens"] == tok["count"]
    docs = [{"title": "A", "text": "x"}, {"title": "BC", "text": "y"}]
    r = _ok(http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "documents": docs}))
    assert r["usage"]["prompt_tokens"] == tok["count"] + len("(doc A)(doc BC)")
    cont = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    tok = _ok(http.post("/tokenize", json={"messages": cont, "chat_template": TEMPLATE, "add_special_tokens": False,
                                           "add_generation_prompt": False, "continue_final_message": True}))
    assert bytes(tok["tokens"]).decode() == "[user]Hi\n[assistant]Well"
    for template, fragment in (("{% for %}", "chat template"), ("{{ raise_exception('no such role') }}", "no such role"),
                               ("{{ ''.__class__.__mro__ }}", "chat template")):
        _error(http.post("/v1/chat/completions", json={"messages": USER, "chat_template": template}), 400,
               "chat_template", fragment)
    _error(http.post("/tokenize", json={"prompt": "x", "chat_template": TEMPLATE}), 400, None, "goes with 'messages'")


def test_request_chat_template_needs_trust():
    """Without --trust-request-chat-template (the default) a request's template is refused before it runs."""
    from tp_overlap_plugin.serving.entrypoints.openai.server_errors import ApiError
    from tp_overlap_plugin.serving.entrypoints.openai.serving_base import OpenAIServing

    engine = types.SimpleNamespace(tokenizer=None, max_model_len=MAX_LEN, input_processor=None)
    serving = OpenAIServing(engine, "demo", None, None)
    with pytest.raises(ApiError) as e:
        serving._chat_text(USER, True, chat_template=TEMPLATE)
    assert e.value.param == "chat_template" and "--trust-request-chat-template" in e.value.message


def _metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(vllm:request_(?:prompt|generation)_tokens_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_cache_salt_keeps_prefix_blocks_apart(http):
    prompt = "cache salt test: " + "the same long prefix, " * 3   # several 16-token blocks, seen nowhere else

    def hits():
        m = re.search(r"^tp_overlap_prefix_cache_hit_blocks_total\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
        return float(m.group(1))

    texts, gained = [], []
    for salt in ("salt-A", "salt-B", "salt-A", None):
        before = hits()
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        texts.append(_ok(http.post("/v1/completions", json=body))["choices"][0]["text"])
        gained.append(hits() - before)
    assert gained[0] == 0 and gained[1] == 0 and gained[2] > 0 and gained[3] == 0, gained
    assert len(set(texts)) == 1


def test_request_token_histograms_grow_with_each_request(http):
    before = _metrics(http)
    labels = '{engine="0",model_name="demo"}'
    buckets = [k for k in before if k.startswith("vllm:request_prompt_tokens_bucket")]
    les = [re.search(r'le="([^"]+)"', k).group(1) for k in buckets]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"], les   # vLLM's 1-2-5 to max_model_len
    r = _ok(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 7, "ignore_eos": True, "n": 2}))
    after = _metrics(http)
    for name, per_choice in (("prompt", r["usage"]["prompt_tokens"]), ("generation", 7)):
        key = f"vllm:request_{name}_tokens_"
        assert after[key + "count" + labels] == before[key + "count" + labels] + 2
        assert after[key + "sum" + labels] == before[key + "sum" + labels] + 2 * per_choice


def test_request_body_limit_is_a_413_and_the_server_stays_healthy(server, http):
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)})
    err = _error(http.post("/tokenize", content=big, headers={"Content-Type": "application/json"}), 413, None,
                 f"limit of {BODY_LIMIT} bytes")
    assert err["code"] == "request_too_large"

    def chunked():   # no Content-Length: the limit is found while reading
        for _ in range(BODY_LIMIT // 4096 + 4):
            yield b" " * 4096
    r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    _error(r, 413, None, "more than")
    assert httpx.get(server.url + "/health").status_code == 200
    _ok(http.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1}))   # under the limit: served


def test_env_and_cli_settings(monkeypatch):
    from tp_overlap_plugin import options
    from tp_overlap_plugin.serving.entrypoints.openai.server_config import DEFAULT_MAX_BODY_BYTES

    monkeypatch.delenv("TP_OVERLAP_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert options.env_api_key(vllm_too=True) == "v" and options.env_api_key() is None
    monkeypatch.setenv("TP_OVERLAP_API_KEY", "t")
    assert options.env_api_key(vllm_too=True) == "t"
    assert 1 << 20 <= DEFAULT_MAX_BODY_BYTES <= 16 << 20
    monkeypatch.setenv("TP_OVERLAP_MAX_REQUEST_BODY_BYTES", "12345")
    assert options.env_max_request_body_bytes() == 12345

    import argparse

    from tp_overlap_plugin.cli.serve import add_server_args

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(parser)
    a = parser.parse_args(["--max-request-body-bytes", "1000", "--trust-request-chat-template"])
    assert a.max_request_body_bytes == 1000 and a.trust_request_chat_template
    assert not parser.parse_args([]).trust_request_chat_template
    for bad in ("0", "8M"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(["--max-request-body-bytes", bad])


def test_responses_take_vllm_priority_and_cache_salt(http):
    body = {"input": "Hi", "max_output_tokens": 2, "store": False}
    _ok(http.post("/v1/responses", json={**body, "priority": 0, "cache_salt": "salt-R", "foo": None}))
    _error(http.post("/v1/responses", json={**body, "priority": 2}), 400, "priority", "first come, first served")
    _error(http.post("/v1/responses", json={**body, "cache_salt": ""}), 400, "cache_salt")
