"""Sampling parameters and structured output, in-process.

The sampler's logits processing (logit_bias, repetition / frequency / presence penalties) against
transformers' processors and a float64 formula on random logits and histories, including the device
update of the counts by the sampled tokens; top logprobs of the raw distribution; the bitmask. JSON
output from the demo model (random weights: only the grammar makes it JSON) and from an HF
byte-level tokenizer, validated against its schema. Preemption rebuilds the state and keeps the
grammar. (test_engine_hf_parity.py runs the penalties end to end against transformers;
test_engine_async.py runs them and the grammar under async scheduling, preemption and TP=2.)
"""

import importlib.util
import json

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from tp_overlap_plugin.serving import LLM, EngineConfig, SamplingParams
from tp_overlap_plugin.serving.config import RequestError
from tp_overlap_plugin.serving.model.sampler import TokenState, sample_on_device

V = 250   # not a multiple of 32: the bitmask's last word is partial
# CI installs both (the serve and test extras); a bare GPU image may not have them.
needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar")


def _reference(logits, prompt, output, p: SamplingParams) -> torch.Tensor:
    """float64: transformers' bias and repetition processors, then OpenAI's frequency / presence."""
    ids = torch.tensor([prompt + output])
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}))
    procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    x = LogitsProcessorList(procs)(ids, logits.double()[None].clone())[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V).double()
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()


def test_penalties_and_bias_match_references_across_steps():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(temperature=0, logit_bias={3: 5.5, 249: -100.0, 0: 0.25}),
              SamplingParams(temperature=0),                                  # no state row
              SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=2.0,
                             logit_bias={7: -3.0})]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 9, 4, 6, 17)]
    # repeats in the outputs, so that counts above 1 matter; the last sequence has generated nothing yet
    outputs = [torch.randint(0, 12, (n,), generator=g).tolist() for n in (5, 8, 3, 2, 0)]
    state = TokenState(8, V, "cpu")
    # A row used and released by an earlier sequence must come back clean.
    old = state.acquire(list(range(V)), [5] * 40, SamplingParams(frequency_penalty=1.0, logit_bias={9: 80.0}))
    state.release(old)
    rows = [state.acquire(prompts[i], outputs[i], params[i]) if params[i].needs_token_state else -1
            for i in range(len(params))]
    assert old in rows
    for step in range(3):
        logits = torch.randn(len(params), V, generator=g) * 3
        logits[:, 0] = 0.0   # the repetition penalty's boundary: neither divided nor multiplied
        ref = torch.stack([_reference(logits[i], prompts[i], outputs[i], params[i]) for i in range(len(params))])
        x = logits.clone()
        live = [i for i, r in enumerate(rows) if r >= 0]
        state.apply(x, torch.tensor(live), torch.tensor([rows[i] for i in live]), [params[i] for i in live])
        torch.testing.assert_close(x.double(), ref, atol=1e-5, rtol=1e-5)
        before = logits.clone()
        out = sample_on_device(logits, params, [None] * len(params), torch.Generator(), state, rows)
        assert torch.equal(logits, before)   # the step's logits are not processed in place
        assert out.tokens.tolist() == ref.argmax(-1).tolist()
        assert out.logprobs is None
        # The sampled tokens were counted on the device: the next step's reference includes them.
        for i, t in enumerate(out.tokens.tolist()):
            outputs[i].append(t)


def test_top_logprobs_are_of_the_raw_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=20, logit_bias={5: 100.0}),
              SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0.9, logprobs=True, top_logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0)]
    state = TokenState(4, V, "cpu")
    rows = [state.acquire([1, 2], [], p) if p.needs_token_state else -1 for p in params]
    out = sample_on_device(logits, params, [None] * 4, torch.Generator().manual_seed(0), state, rows)
    raw = torch.log_softmax(logits.double(), -1)
    assert out.tokens[0] == 5   # the bias decided the token ...
    # ... and the reported log-probabilities are still the model's own
    torch.testing.assert_close(out.logprobs.double(), raw.gather(1, out.tokens[:, None])[:, 0])
    want_lp, want_ids = raw.topk(20, dim=-1)
    assert out.top_ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(out.top_logprobs.double(), want_lp)
    with pytest.raises(ValueError, match="less than or equal to 20"):
        SamplingParams(logprobs=True, top_logprobs=21)
    with pytest.raises(ValueError, match="needs logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 100.5})


@needs_xgrammar
def test_bitmask_allows_only_its_tokens():
    g = torch.Generator().manual_seed(2)
    b, n = 6, 400
    words = (V + 31) // 32
    allowed = torch.rand(b, words * 32, generator=g) < 0.1
    allowed[:, V:] = False
    allowed[1] = False
    allowed[1, V - 1] = True                   # a single token, in the partial last word
    bits = (allowed.view(b, words, 32).long() << torch.arange(32)).sum(-1)
    mask = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    masked = [0, 1, 3, 4]                      # rows 2 and 5 are unconstrained
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, top_k=40), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=0)]
    logits = torch.randn(b, V, generator=g)
    gen = torch.Generator().manual_seed(3)
    drawn = torch.stack([sample_on_device(logits, params, [None] * b, gen, token_bitmask=mask, masked=masked).tokens
                         for _ in range(n // 10)])
    for i in masked:
        assert allowed[i, drawn[:, i]].all(), i
    assert drawn[:, 1].eq(V - 1).all()
    best_allowed = logits[0].masked_fill(~allowed[0, :V], float("-inf")).argmax()
    assert drawn[:, 0].eq(best_allowed).all()
    assert drawn[:, 2].eq(logits[2].argmax()).all() and drawn[:, 5].eq(logits[5].argmax()).all()


# ---- structured output -----------------------------------------------------------------------------
# Short keys: the byte tokenizer spends a step per character. Every value is bounded, so that even a
# model with random weights finishes the object. (Strings are bounded by a pattern, not maxLength:
# xgrammar 0.2.8 lets unescaped control characters into length-bounded strings, which is not JSON.)
SCHEMA = {
    "type": "object",
    "properties": {
        "b": {"type": "boolean"},
        "c": {"enum": ["red", "blue"]},
        "n": {"type": "integer", "minimum": -9, "maximum": 99},
        "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "p": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{1,2}$"}},
              "required": ["s"], "additionalProperties": False},
    },
    "required": ["b", "c", "n", "t", "p"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "Give me JSON:", "0123456789"]


@pytest.fixture(scope="module")
def llm():
    with LLM(EngineConfig(model="demo", max_model_len=128, max_num_seqs=16, num_kv_blocks=64,
                          show_progress=False)) as m:
        yield m


def _valid(out, schema=None) -> dict:
    import jsonschema

    c = out.outputs[0]
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    doc = json.loads(c.text)
    assert isinstance(doc, dict)
    if schema is not None:
        jsonschema.validate(doc, schema)
    return doc


@needs_xgrammar
def test_json_schema_output_validates(llm):
    so = {"json_schema": SCHEMA}
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    solo = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    params = ([SamplingParams(temperature=0, max_tokens=80, structured_output=so)] * len(PROMPTS)
              + [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_output=so) for s in range(3)]
              + [plain] * len(PROMPTS))
    outs = llm.generate(PROMPTS * 3, params)
    docs = [_valid(o, SCHEMA) for o in outs[:2 * len(PROMPTS)]]
    assert len({json.dumps(d) for d in docs}) > 2   # the prompts and seeds matter: not one canned answer
    # Unconstrained requests in the same batch are untouched by the mask.
    assert [o.outputs[0].token_ids for o in outs[2 * len(PROMPTS):]] == solo


@needs_xgrammar
def test_json_object_and_truncation(llm):
    greedy = SamplingParams(temperature=0, max_tokens=64, structured_output={"json_object": True})
    for out in llm.generate(PROMPTS, greedy):
        _valid(out)
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    assert not any(o.outputs[0].text.startswith("{") for o in free)   # without the grammar: no JSON
    cut = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, structured_output={"json_schema": SCHEMA}))
    c = cut[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5 and c.text == '{"b":'


@needs_xgrammar
def test_bad_schema_and_bias_ids_are_request_errors(llm):
    for so, fragment in (({"json_schema": {"type": "object", "properties": 5}}, "properties must be an object"),
                         ({"json_schema": {"type": "strng"}}, "strng")):
        with pytest.raises(RequestError, match=fragment) as e:
            llm.generate("x", SamplingParams(structured_output=so))
        assert e.value.param == "structured_output"
    with pytest.raises(RequestError, match=r"320 is outside the vocabulary \[0, 320\)") as e:
        llm.generate("x", SamplingParams(logit_bias={320: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_output={"json_object": True})
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_output={"json_object": True, "json_schema": SCHEMA})


@needs_xgrammar
@pytest.mark.timeout(120)
def test_hf_byte_level_tokenizer(tmp_path):
    """Grammar and token bytes with an HF byte-level BPE tokenizer (merged tokens span several bytes)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from serving_helpers import make_hf_checkpoint

    d = make_hf_checkpoint("qwen2", tmp_path / "m", vocab_size=300, max_shard_size=None)
    bpe = ByteLevelBPETokenizer()
    text = ['{"b": true, "c": "blue", "n": 12, "t": ["a"], "p": {"s": "ab"}} café'] * 20
    bpe.train_from_iterator(text, vocab_size=290, min_frequency=1, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.save_pretrained(str(d))
    with LLM(model=str(d), max_model_len=256, num_kv_blocks=64, block_size=8, show_progress=False) as llm:
        outs = llm.generate(["the", "ok"], SamplingParams(temperature=0, max_tokens=150,
                                                          structured_output={"json_schema": SCHEMA}))
        for o in outs:
            _valid(o, SCHEMA)
        ids = outs[0].outputs[0].token_ids[:-1]   # (the last one is the end-of-sequence token)
        assert any(len(llm.tokenizer.token_bytes(t)) > 1 for t in ids)
        assert b"".join(llm.tokenizer.token_bytes(t) for t in ids) == outs[0].outputs[0].text.encode()
        cafe = tok.encode(" café", add_special_tokens=False)
        assert b"".join(llm.tokenizer.token_bytes(t) for t in cafe) == " café".encode()


@needs_xgrammar
def test_preemption_rebuilds_token_state_and_keeps_the_grammar():
    """A preempted sequence gives its TokenState row back and rebuilds it from its tokens; its grammar
    matcher carries on. Outputs equal those of an engine that never preempts."""
    import random

    from tp_overlap_plugin.serving import LLMEngine

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(10, 25), ignore_eos=True, repetition_penalty=1.4,
                             frequency_penalty=0.6, presence_penalty=0.3, logit_bias={rng.randrange(256): 3.0})
              for _ in prompts[:6]]
    params += [SamplingParams(temperature=0, max_tokens=90, structured_output={"json_schema": SCHEMA},
                              frequency_penalty=0.5)] * 2

    def run(num_kv_blocks):
        eng = LLMEngine(EngineConfig(model="demo", block_size=4, max_model_len=128, max_num_seqs=8,
                                     max_num_batched_tokens=24, num_kv_blocks=num_kv_blocks, show_progress=False))
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                eng.add_request(f"r{i}", p, sp)
            done = {}
            while eng.has_unfinished():
                done.update({o.request_id: o for o in eng.step() if o.finished})
            assert eng.token_state.num_free == 8   # every row came back
            outs = [done[f"r{i}"] for i in range(len(prompts))]
            return ([o.num_preemptions for o in outs],
                    [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        finally:
            eng.shutdown()

    roomy, ref = run(400)
    tight, got = run(32)
    assert sum(roomy) == 0
    assert any(tight[:6]) and any(tight[6:]), tight   # penalized and constrained sequences were preempted
    assert got == ref
    for ids, reason in ref[6:]:
        assert reason == "stop" and set(json.loads(bytes(ids[:-1]).decode())) == set(SCHEMA["required"])


@needs_xgrammar
def test_a_grammar_that_refuses_its_own_token_ends_only_that_request(llm, caplog):
    eng = llm.engine
    so = SamplingParams(temperature=0, max_tokens=40, structured_output={"json_schema": SCHEMA})
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate("Hello", plain)[0].outputs[0].token_ids
    eng.add_request("bad", "x", so)
    eng.add_request("ok", "Hello", plain)
    eng.step()
    eng.scheduler.by_id["bad"].grammar.accept_token = lambda token: False   # as a library bug would
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
    assert done["bad"].finish_reason == "abort" and "refused token" in caplog.text
    assert done["ok"].token_ids == ref and done["ok"].finish_reason == "length"
    assert eng.token_state.num_free == eng.token_state.num_rows


def test_min_tokens_and_skip_special_tokens_in_a_mixed_batch(llm):
    # The bias makes the end-of-sequence token (257) the likeliest at every step; min_tokens holds it back
    # for its own request only (async scheduling launches a step before the host has the last token).
    eos = {257: 100.0}
    params = [SamplingParams(temperature=0, max_tokens=20, logit_bias=eos, min_tokens=m) for m in (0, 1, 7)]
    params.append(SamplingParams(temperature=0.9, seed=4, max_tokens=20, logit_bias=eos, min_tokens=3))
    outs = llm.generate(["Hi"] * len(params), params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 8, 4]
    assert all(o.outputs[0].token_ids[-1] == 257 and o.outputs[0].finish_reason == "stop" for o in outs)
    with pytest.raises(ValueError, match="min_tokens=5 is more than max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    special = {260: 100.0}   # <|assistant|>
    kept, skipped = llm.generate(["Hi", "Hi"], [SamplingParams(temperature=0, max_tokens=2, logit_bias=special,
                                                               skip_special_tokens=s) for s in (False, True)])
    assert kept.outputs[0].text == "<|assistant|>" * 2 and skipped.outputs[0].text == ""


@needs_xgrammar
def test_regex_choice_and_grammar_constraints(llm):
    import re

    cases = [({"regex": "[0-9]{2}-[a-c]"}, lambda t: re.fullmatch("[0-9]{2}-[a-c]", t)),
             ({"choice": ["red", "green", 'say "hi"']}, lambda t: t in ("red", "green", 'say "hi"')),
             ({"grammar": 'root ::= "x" [0-9] ("!" | "?")'}, lambda t: re.fullmatch(r"x[0-9][!?]", t))]
    for so, ok in cases:
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_output=so)
                                      for s in range(len(PROMPTS))])
        for o in outs:
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (so, o.outputs[0].text)
    with pytest.raises(RequestError, match="the regex cannot be used") as e:
        llm.generate("x", SamplingParams(structured_output={"regex": "(a"}))
    assert e.value.param == "structured_output"
