"""Incremental detokenization is exact: the deltas, flushed at the end, concatenate to the
tokenizer's decode of the output ids, and every delta is a prefix of that final text, for random
token sequences of a byte-level BPE tokenizer (multi-byte characters split across tokens) and of
the byte tokenizer. The engine's finished texts and streamed deltas agree with the decode too."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tp_overlap_plugin.serving.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

VOCAB = 600
SPECIALS = ["<|eos|>", "<|end|>"]
# Words of several scripts, so merges cover parts of 2-, 3- and 4-byte characters.
WORDS = ("tensor parallel overlap kernel gather scatter reduce matrix memory heap rank peer flag epoch "
         "token stream decode prefill batch cache block schedule request server engine latency "
         "中文 字符 测试 张量 并行 内存 日本語 テキスト 한국어 😀 🚀 🎉 👍🏽 "
         "ünïcödé naïve Ωμέγα привет").split()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) + rng.choice(["", "s", "ed", "ing", "。", "!", ",", "42"])
                      for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    assert tok.get_vocab_size() == VOCAB
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    return HFTokenizer(d)   # the adapter the engine uses for a model directory


def _stream(tok, prompt, ids):
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


def _check(tok, prompt, ids):
    final = tok.decode(ids, skip_special_tokens=True)
    deltas = _stream(tok, prompt, ids)
    assert "".join(deltas) == final
    # emitted text never changes afterwards: every partial concatenation is a prefix of the final
    # text (implied by the line above, but this names the first delta that broke it)
    sent = ""
    for i, d in enumerate(deltas):
        sent += d
        assert final.startswith(sent), (i, sent, final)


_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(prompt=st.lists(st.integers(0, VOCAB - 1), max_size=6),
       ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
def test_bpe_deltas_concatenate_to_decode(bpe, prompt, ids):
    _check(bpe, prompt, ids)


@_SETTINGS
@given(prompt=st.lists(st.integers(0, 263), max_size=6),
       ids=st.lists(st.one_of(st.integers(0x80, 0xFF), st.integers(0, 270)), min_size=1, max_size=40))
def test_byte_tokenizer_deltas_concatenate_to_decode(prompt, ids):
    _check(ByteTokenizer(), prompt, ids)


def test_partial_character_is_held_however_many_tokens_it_takes():
    # A lone continuation byte, then a 4-byte emoji one byte per token: the text ends in U+FFFD for
    # four tokens, and the fifth completes the character.
    tok = ByteTokenizer()
    ids = [0x80, *"😀".encode(), *b"ok"]
    assert "".join(_stream(tok, [], ids)) == "\ufffd😀ok"
    # the case: a 3-byte character, one byte per token, after a prompt
    assert "".join(_stream(tok, list(b"x"), [*b"mem", 0xE3, 0xA1, 0x8F, *b"at"])) == "mem㡏at"


def test_flush_emits_a_partial_character_left_at_the_end():
    tok = ByteTokenizer()
    deltas = _stream(tok, [], [*b"ab", 0xE4, 0xB8])
    assert deltas[-1] == "\ufffd" and "".join(deltas) == "ab\ufffd"


@pytest.fixture(scope="module")
def demo_engine():
    from tp_overlap_plugin.serving import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model="demo", max_model_len=128, show_progress=False))
    yield eng
    eng.shutdown()


def test_engine_text_equals_decode_of_output_ids(demo_engine):
    """Finished texts of the demo model (random weights: random bytes, invalid UTF-8 included) equal
    the decode of their output ids, whether the output ends by length or by a stop token, and the
    streamed deltas concatenate to them."""
    from tp_overlap_plugin.serving import SamplingParams

    eng = demo_engine
    tok = eng.tokenizer
    end = tok.special_ids["<|end|>"]
    deltas: dict[str, list[str]] = {}
    finals = {}
    for i in range(12):
        params = SamplingParams(temperature=1.5, seed=i, max_tokens=48, stop_token_ids=[end] if i % 2 else [])
        rid = eng.add_request(f"r{i}", "Hi " * (i % 3 + 1), params)
        deltas[rid] = []
    while eng.has_unfinished():
        for out in eng.step():
            deltas[out.request_id].append(out.delta_text)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert len(finals) == 12
    for rid, comp in finals.items():
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True), rid
        assert "".join(deltas[rid]) == comp.text, rid
    assert any(any(t >= 0x80 for t in c.token_ids) for c in finals.values())



@pytest.mark.parametrize("end", ["eos", "stop_token", "length"])
def test_engine_emits_held_back_text_when_the_output_ends(demo_engine, monkeypatch, end):
    """The output ends one byte short of a character: the text is still the decode of the output ids,
    and the last delta carries the held-back bytes, whatever ended the output."""
    from tp_overlap_plugin.serving import SamplingParams
    from tp_overlap_plugin.serving.worker import runner as engine_mod
    from tp_overlap_plugin.serving.model.sampler import Sampled

    tok = demo_engine.tokenizer
    script = [*b"ok", 0xE4, 0xB8]
    params = dict(max_tokens=len(script), temperature=0)
    if end == "eos":
        script.append(tok.eos_token_id)
        params["max_tokens"] += 1
    elif end == "stop_token":
        script.append(tok.special_ids["<|end|>"])
        params.update(max_tokens=len(script), stop_token_ids=[tok.special_ids["<|end|>"]])
    scripted = iter(script)
    monkeypatch.setattr(engine_mod, "sample_on_device",
                        lambda logits, ps, gens, gen, **kw: Sampled(torch.tensor([next(scripted)],
                                                                                  device=logits.device)))
    demo_engine.add_request("scripted", "Hi", SamplingParams(**params))
    outs = []
    while demo_engine.has_unfinished():
        outs += demo_engine.step()
    final = outs[-1].outputs[0]
    assert final.finish_reason == ("length" if end == "length" else "stop")
    assert final.token_ids == script
    assert final.text == tok.decode(script) == "ok\ufffd"
    assert "".join(o.delta_text for o in outs) == final.text and outs[-1].delta_text == "\ufffd"
