"""Stop strings through the front end (engine/request_stream.py): streamed text equals the finished
text for every stop string and both include_stop_str_in_output settings, and both equal the greedy
text cut at the first match.

The stop strings are taken from the demo model's own greedy outputs (so they hit, at their first
occurrence or later, across token boundaries, overlapping themselves like "nnn" in "nnnnn...") plus
strings that never occur. All requests run in one batch of the in-process engine: a few seconds.
"""

from __future__ import annotations

import pytest

from tp_overlap_plugin.serving import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["Hello", "The tensor-parallel engine says:", "0123456789", "abc"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(model="demo", max_model_len=128, max_num_seqs=128, show_progress=False))
    yield eng
    eng.shutdown()


def _run(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, tuple[str, object]]:
    """request id -> (the streamed deltas joined, the finished CompletionOutput)."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    streamed = {rid: [] for rid in requests}
    final = {}
    while len(final) < len(requests):
        for out in eng.step():
            streamed[out.request_id].append(out.delta_text)
            assert out.outputs[0].text == "".join(streamed[out.request_id]), "the text so far is what was sent"
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert not eng.has_unfinished(), "a request a stop string ended is still in the core"
    return {rid: ("".join(streamed[rid]), final[rid]) for rid in requests}


def _stop_strings(text: str) -> list[str]:
    """Substrings of `text` of 1 to 5 characters, from its start, middle and end, and a few that the
    text does not contain (sharing a prefix with it, so that they are held back and then released)."""
    out = []
    for n in (1, 2, 3, 5):
        for at in (0, 1, len(text) // 3, len(text) // 2, len(text) - n):
            if 0 <= at <= len(text) - n:
                out.append(text[at:at + n])
    out += [text[:2] + "\x00", text[-1:] + "never", "zzzz-not-there"]
    return list(dict.fromkeys(s for s in out if s))


def test_streamed_text_equals_the_finished_text_for_every_stop_string(engine):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full = {p: o[1] for p, o in _run(engine, {p: (p, greedy) for p in PROMPTS}).items()}
    requests, expected = {}, {}
    for p in PROMPTS:
        text = full[p].text
        for j, stop in enumerate(_stop_strings(text)):
            for include in (False, True):
                rid = f"{p}|{j}|{include}"
                requests[rid] = (p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                   stop=[stop], include_stop_str_in_output=include))
                i = text.find(stop)
                expected[rid] = (text if i < 0 else text[:i + len(stop) if include else i], i >= 0)
        # Several stop strings at once: the output ends at the first one that completes.
        stops = _stop_strings(text)[-4:] + [text[5:8]]
        requests[f"{p}|many"] = (p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stops))
    assert len(requests) > 80
    results = _run(engine, requests)
    hits = 0
    for rid, (streamed, comp) in results.items():
        prompt = rid.split("|")[0]
        assert streamed == comp.text, (rid, streamed, comp.text)
        assert comp.token_ids == full[prompt].token_ids[:len(comp.token_ids)], rid
        if rid in expected:
            text, hit = expected[rid]
            assert comp.text == text, (rid, comp.text, text)
            assert comp.finish_reason == ("stop" if hit else "length"), rid
            if hit:
                hits += 1
                assert len(comp.token_ids) < MAX_TOKENS or text == full[prompt].text[:len(text)], rid
    print("hits", hits, "of", len(expected)); assert hits > 40, "too few stop strings hit: the test would not see a leak"


def test_the_issues_case_streams_nothing(engine):
    """`Hello` with stop "nnn": the demo's greedy text begins with n's, so nothing is ever sent."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["nnn"])
    (streamed, comp), = _run(engine, {"nnn": ("Hello", params)}).values()
    assert streamed == comp.text == "" and comp.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["nnn"], include_stop_str_in_output=True)
    (streamed, comp), = _run(engine, {"nnn+": ("Hello", params)}).values()
    assert streamed == comp.text == "nnn"


def _first_match_after(text: str, stops: list[str], m: int) -> str:
    """`text` (one character per token) cut at the first stop string that ends after its m-th character."""
    for end in range(m + 1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s):end] == s]
        if starts:
            return text[:min(starts)]
    return text


def test_min_tokens_lets_stop_strings_pass_and_no_later_window_finds_them(engine):
    """No stop string before min_tokens (vLLM's); a short one that passed then is not found afterwards just
    because a longer stop string widens the window the next text is searched in."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full = {p: o[1] for p, o in _run(engine, {p: (p, greedy) for p in PROMPTS}).items()}
    requests, expected = {}, {}
    for p in PROMPTS:
        text = full[p].text
        if not (text.isascii() and len(text) == len(full[p].token_ids)):   # one character per token
            continue
        for m in (3, 6, 10):
            stops = [text[1:3], text[m - 2:m], "zzzzzzzz-never"]
            rid = f"{p}|{m}"
            requests[rid] = (p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stops,
                                               min_tokens=m))
            expected[rid] = _first_match_after(text, stops, m)
    assert len(requests) >= 3
    for rid, (streamed, comp) in _run(engine, requests).items():
        assert streamed == comp.text == expected[rid], (rid, streamed, comp.text, expected[rid])
        assert len(comp.token_ids) > int(rid.rsplit("|", 1)[1]), rid   # the match ended after min_tokens


def test_async_llm_streams_the_same_and_frees_the_request_in_its_core(engine):
    """The same front end under AsyncLLM (core loop on a thread, same pipes): the streamed text equals
    the offline one, and the request a stop string ended is aborted in the core (its blocks freed)."""
    import asyncio

    from tp_overlap_plugin.serving import AsyncLLM

    text = _run(engine, {"ref": ("Hello", SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))})
    full = text["ref"][1].text
    stop = full[4:7]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    expected = _run(engine, {"offline": ("Hello", params)})["offline"][1]
    eng = AsyncLLM(EngineConfig(model="demo", max_model_len=128, show_progress=False), in_thread=True)

    async def main():
        outs = [o async for o in eng.generate("Hello", params, "s")]
        for _ in range(500):
            if eng.stats()["num_requests_running"] == 0 and eng.stats()["num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        return outs

    try:
        outs = asyncio.run(main())
        assert "".join(o.delta_text for o in outs) == outs[-1].outputs[0].text == expected.text == full[:full.find(stop)]
        assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].token_ids == expected.token_ids
        stats = eng.stats()
        assert stats["num_requests_running"] == 0 and stats["kv_cache_free_blocks"] == stats["kv_cache_total_blocks"]
    finally:
        eng.shutdown()
