"""Async scheduling (EngineConfig.async_scheduling): step i+1 is launched before step i's tokens reach
the host. Outputs equal the synchronous engine's, with stops the host cannot foresee (stop tokens, stop
strings), seeded sampling, logprobs and top logprobs, penalties and logit_bias (token counts the device
updates before the host sees the tokens), structured output (a grammar that must see each token
before the next mask), prompt logits, preemption and aborts, at TP=1 and TP=2; no KV block leaks."""

import json

import pytest
import torch

from tp_overlap_plugin.serving import EngineConfig, LLMEngine, SamplingParams

# The demo model's greedy output for "zz" changes token after ~10 steps: a stop there is mid-run.
PROMPTS = ["Hello there", "zz", "a", "zz",
           [5, 17, 99, 200, 3, 8], "zz", "1 2 3 4 5 6 7 8 9", "Another one"]


def _engine(async_scheduling: bool, tp: int, **kw) -> LLMEngine:
    base = dict(model="demo", block_size=4, max_model_len=64, max_num_seqs=6, max_num_batched_tokens=24,
                num_kv_blocks=20, show_progress=False, dist_timeout_s=60, tensor_parallel_size=tp,
                async_scheduling=async_scheduling)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


def _params(stop_token: int, stop_str: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.2, logit_bias={65: 3.0}),
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token], logprobs=True, top_logprobs=4),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=25),
            SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, prompt_logits=True, logprobs=True),
            SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=33, presence_penalty=1.5,
                           logit_bias={97: -100.0, 98: 2.0}),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=50, structured_output={"json_schema": SCHEMA})]


def _run(eng: LLMEngine, params, abort_after: dict | None = None) -> dict:
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        eng.add_request(f"r{i}", p, sp)
    done, steps = {}, 0
    while eng.has_unfinished():
        for rid, at in (abort_after or {}).items():
            if steps == at and rid not in done:
                out = eng.abort_request(rid)
                done[rid] = (out.outputs[0].token_ids, "abort")
        for out in eng.step():
            if out.finished and out.request_id not in done:
                c = out.outputs[0]
                pl = out.prompt_logits
                done[out.request_id] = (c.token_ids, c.finish_reason, c.text,
                                        None if c.logprobs is None else [round(x, 4) for x in c.logprobs],
                                        None if pl is None else pl.shape,
                                        None if c.top_logprobs is None else
                                        [[(t, round(x, 4)) for t, x in top] for top in c.top_logprobs])
        steps += 1
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    assert all(r == 0 for r in eng.block_manager.refcount)
    return done


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_async_scheduling_equals_sync(tp):
    sync = _engine(False, tp)
    try:
        # A stop token and a stop string the greedy runs actually produce mid-way, so that those requests
        # stop on a token the async engine has already scheduled past.
        sync.add_request("probe", "zz", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        outs = {}
        while sync.has_unfinished():
            outs.update({o.request_id: o.outputs[0] for o in sync.step()})
        toks = outs["probe"].token_ids
        k = next(i for i, t in enumerate(toks) if t != toks[0])
        stop_str = sync.tokenizer.decode([toks[k]])
        assert 2 < k and stop_str
        params = _params(toks[k], stop_str)
        ref = _run(sync, params)
    finally:
        sync.shutdown()
    eng = _engine(True, tp)
    try:
        got = _run(eng, params)
        assert got == ref
        assert ref["r1"][1] == "stop" and ref["r3"][1] == "stop" and ref["r0"][1] == "length"
        assert ref["r7"][1] == "stop" and json.loads(ref["r7"][2]).keys() == {"ok", "n"}
        assert len(ref["r1"][5]) == len(ref["r1"][0]) and all(len(top) == 4 for top in ref["r1"][5])
        assert eng.scheduler.num_preemptions > 0   # the small pool made the run preempt
    finally:
        eng.shutdown()


@pytest.mark.timeout(120)
def test_async_abort_mid_flight_frees_everything():
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS)
    ref_eng = _engine(False, 1)
    ref = _run(ref_eng, params, abort_after={"r1": 6, "r4": 9})
    ref_eng.shutdown()
    eng = _engine(True, 1)
    got = _run(eng, params, abort_after={"r1": 6, "r4": 9})
    eng.shutdown()
    # The abort lands at a different token (one step is in flight), the others are unaffected.
    for rid in ref:
        if rid not in ("r1", "r4"):
            assert got[rid] == ref[rid]
    assert got["r1"][1] == "abort" and got["r4"][1] == "abort"
    torch.testing.assert_close(len(got), len(ref))
