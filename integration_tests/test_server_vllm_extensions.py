"""vLLM's request extensions on the demo server, sent as a vLLM user sends them (the OpenAI SDK's
`extra_body`): guided decoding (guided_json / guided_regex / guided_choice / guided_grammar and the newer
structured_outputs object), min_tokens, skip_special_tokens, prompt_logprobs, chat's echo /
continue_final_message / chat_template_kwargs, request_id and X-Request-Id, continuous usage in streams,
best_of above n; and the vLLM-named series on /metrics. The demo's byte tokenizer makes the expected
texts checkable: specials are ids 256.. (257 end-of-sequence, 260 `<|assistant|>`)."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from serving_helpers import ServerProcess

pytestmark = pytest.mark.timeout(180)

MAX_LEN = 128
EOS, ASSISTANT = 257, 260
USER = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-model-len", str(MAX_LEN), "--no-access-log", "--log-level", "warning"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, extra, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model="demo", messages=kw.pop("messages", USER), extra_body=extra, **kw)


def test_guided_choice_regex_grammar_and_json(client):
    choices = ["yes", "no", "a \"quoted\" maybe"]
    for seed in range(2):
        r = _chat(client, {"guided_choice": choices}, temperature=1.0, seed=seed, n=2)
        assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
        r = client.completions.create(model="demo", prompt="Code:", max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
        r = _chat(client, {"structured_outputs": {"grammar": 'root ::= ("ab" | "cd") "!"'}}, temperature=1.0,
                  seed=seed)
        assert r.choices[0].message.content in ("ab!", "cd!")
        r = _chat(client, {"structured_outputs": {"choice": ["left", "right"]}}, temperature=1.0, seed=seed)
        assert r.choices[0].message.content in ("left", "right")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    # vLLM takes the schema as an object or as its JSON text, at the top level or in structured_outputs.
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        r = _chat(client, extra, temperature=0.7, seed=1, max_tokens=40)
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_min_tokens_holds_back_eos_and_stop_ids(client):
    # The bias makes the end-of-sequence token the likeliest at every step: without min_tokens it ends
    # the output at once; with it, it comes right after the min_tokens-th token.
    bias = {str(EOS): 100}
    r = client.completions.create(model="demo", prompt="Hi", max_tokens=20, temperature=0, logit_bias=bias)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    for min_tokens in (1, 5):
        r = client.completions.create(model="demo", prompt="Hi", max_tokens=20, temperature=0, logit_bias=bias,
                                      extra_body={"min_tokens": min_tokens})
        assert r.usage.completion_tokens == min_tokens + 1 and r.choices[0].finish_reason == "stop"
        r = _chat(client, {"min_tokens": min_tokens}, temperature=0.8, seed=3, logit_bias=bias)
        assert r.usage.completion_tokens == min_tokens + 1
    # A stop token id too (here a byte the bias makes likeliest).
    r = client.completions.create(model="demo", prompt="Hi", max_tokens=20, temperature=0, logit_bias={"65": 100},
                                  extra_body={"min_tokens": 4, "stop_token_ids": [65]})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    # No stop string before min_tokens either: "A" would match at the first token.
    r = client.completions.create(model="demo", prompt="Hi", max_tokens=20, temperature=0, logit_bias={"65": 100},
                                  stop=["A"], extra_body={"min_tokens": 3})
    assert r.choices[0].text == "AAA" and r.choices[0].finish_reason == "stop"


def test_skip_special_tokens(client):
    bias = {str(ASSISTANT): 100}
    kept = client.completions.create(model="demo", prompt="Hi", max_tokens=3, temperature=0, logit_bias=bias,
                                     extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "<|assistant|>" * 3
    skipped = client.completions.create(model="demo", prompt="Hi", max_tokens=3, temperature=0, logit_bias=bias)
    assert skipped.choices[0].text == ""
    streamed = client.completions.create(model="demo", prompt="Hi", max_tokens=3, temperature=0, logit_bias=bias,
                                         stream=True, extra_body={"skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "<|assistant|>" * 3


def test_continue_final_message_echo_and_template_kwargs(client):
    opened = USER + [{"role": "assistant", "content": "Once upon"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    cont = _chat(client, {**extra, "ignore_eos": True}, messages=opened, temperature=0, max_tokens=12)
    # The same text as a completion of the rendered prompt with the last message left open.
    raw = client.completions.create(model="demo", prompt="<|user|>Say something<|end|><|assistant|>Once upon",
                                    max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert cont.choices[0].message.content == raw.choices[0].text
    echoed = _chat(client, {**extra, "ignore_eos": True, "echo": True}, messages=opened, temperature=0, max_tokens=12)
    assert echoed.choices[0].message.content == "Once upon" + raw.choices[0].text
    stream = _chat(client, {**extra, "ignore_eos": True, "echo": True}, messages=opened, temperature=0,
                   max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Once upon" + raw.choices[0].text
    # echo with a generation prompt: the reply's role is a new assistant message, the last is the user's.
    plain = _chat(client, {"echo": True, "ignore_eos": True}, temperature=0, max_tokens=6)
    assert not plain.choices[0].message.content.startswith("Say something")
    # Variables the template does not use are ignored, as a Jinja template ignores them.
    r = _chat(client, {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}, temperature=0,
              max_tokens=6)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_request_id_names_the_response_and_the_header(server, client):
    raw = client.chat.completions.with_raw_response.create(model="demo", messages=USER, max_tokens=3,
                                                           extra_body={"request_id": "my-req-1"})
    assert raw.headers["x-request-id"] == "my-req-1" and raw.parse().id == "chatcmpl-my-req-1"
    raw = client.completions.with_raw_response.create(model="demo", prompt="Hi", max_tokens=3, stream=True,
                                                      extra_body={"request_id": "my-req-2"})
    assert raw.headers["x-request-id"] == "my-req-2"
    assert {c.id for c in raw.parse()} == {"cmpl-my-req-2"}
    # The header wins over the body, as in vLLM; without either, the header carries the response id.
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "from-header"}, timeout=30,
                   json={"prompt": "Hi", "max_tokens": 2, "request_id": "from-body"})
    assert r.headers["x-request-id"] == "from-header" and r.json()["id"] == "cmpl-from-header"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.headers["x-request-id"] == r.json()["id"]
    # A client may repeat an id, also while a request with it runs: the engine's ids stay distinct.
    body = {"prompt": "Hi", "max_tokens": 100, "n": 4, "request_id": "dup", "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as first:
        lines = first.iter_lines()
        next(lines)
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        streamed = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert again["id"] == "cmpl-dup" and {c["finish_reason"] for c in again["choices"]} == {"length"}
    assert [c["choices"][0]["finish_reason"] for c in streamed if c["choices"][0]["finish_reason"]] == ["length"] * 4


def test_continuous_usage_stats_on_every_chunk(client):
    stream = client.completions.create(model="demo", prompt="Hi", max_tokens=8, stream=True, temperature=0,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 8 and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8
    chat = list(_chat(client, {"ignore_eos": True}, max_tokens=4, stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4


def test_best_of_returns_the_likeliest_candidates(client):
    # best_of=4 draws the same candidates as n=4 with that seed (seed + j each); it returns the one with
    # the highest cumulative log-probability.
    kw = dict(model="demo", prompt="Once", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    all4 = client.completions.create(n=4, logprobs=0, **kw)
    best = client.completions.create(n=1, best_of=4, **kw)
    ranked = sorted(all4.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.choices[0].text == ranked[0].text
    two = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]


def test_prompt_logprobs_match_echoed_logprobs(client):
    r = client.completions.create(model="demo", prompt="Hello there", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    echo = client.completions.create(model="demo", prompt="Hello there", max_tokens=1, temperature=0, echo=True,
                                     logprobs=2)
    ids = [256] + list(b"Hello there")   # the byte tokenizer: BOS, then the bytes
    assert r.usage.prompt_tokens == len(ids) and len(plp) == len(ids) and plp[0] is None
    for t, entry, lp, top in zip(ids[1:], plp[1:], echo.choices[0].logprobs.token_logprobs[1:],
                                 echo.choices[0].logprobs.top_logprobs[1:]):
        assert 1 <= len(entry) <= 3 and abs(entry[str(t)]["logprob"] - lp) < 1e-4
        assert entry[str(t)]["decoded_token"] == chr(t)
        by_rank = sorted((e["rank"], e["logprob"]) for k, e in entry.items() if k != str(t) or e["rank"] <= 2)
        assert [r for r, _ in by_rank][:2] == [1, 2]
        assert abs(by_rank[0][1] - max(top.values())) < 1e-4
    chat = _chat(client, {"prompt_logprobs": 0}, max_tokens=1)
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_vllm_named_metrics(server, client):
    _chat(client, {"ignore_eos": True}, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    lab = '{engine="0",model_name="demo"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert any(line.startswith(name + lab) for line in text.splitlines()), name
    assert "vllm:generation_tokens_total_total" not in text and "vllm:prompt_tokens_created" not in text
    gen = next(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total{"))
    ours = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("tp_overlap_generation_tokens_total{"))
    assert gen == ours >= 4
    assert re.search(r'^vllm:request_success_total\{engine="0",finished_reason="length",model_name="demo"\} [1-9]',
                     text, re.M)
