"""The step's per-token layout (serving/worker/step_layout.py) against the token-by-token rule it replaced,
and the step timeline (serving/engine/step_trace.py) that an engine writes when TP_OVERLAP_STEP_TRACE is set."""

import random

import numpy as np
import pytest

from tp_overlap_plugin.serving import EngineConfig, LLMEngine, SamplingParams
from tp_overlap_plugin.serving.worker.step_layout import block_table_matrix, layout
from tp_overlap_plugin.serving.engine.step_trace import ENV, read_trace


def _reference(q_lens, ctx, tables, bs):
    pos, slots = [], []
    for q, c, t in zip(q_lens, ctx, tables):
        for p in range(c - q, c):
            pos.append(p)
            slots.append(t[p // bs] * bs + p % bs)
    return pos, slots


@pytest.mark.parametrize("seed", range(4))
def test_layout_matches_token_by_token(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    # decodes first (one token each), then chunks, some starting mid-block; one sequence of one token
    n_dec = rng.randint(0, 5)
    n_pre = rng.randint(0 if n_dec else 1, 4)
    q_lens = [1] * n_dec + [rng.randint(1, 40) for _ in range(n_pre)]
    ctx = [q + rng.randint(0, 50) for q in q_lens]
    # tables may hold more blocks than the context needs (the scheduler reserves ahead)
    tables = [rng.sample(range(1000), -(-c // bs) + rng.randint(0, 2)) for c in ctx]
    lay = layout(q_lens, ctx, tables, bs, pad=999_999)
    pos, slots = _reference(q_lens, ctx, tables, bs)
    assert lay.positions.tolist() == pos and lay.slots.tolist() == slots
    assert lay.cu_seqlens.tolist() == [0, *np.cumsum(q_lens).tolist()]
    width = max(map(len, tables))
    assert lay.block_tables.shape == (len(tables), width)
    for row, t in zip(lay.block_tables.tolist(), tables):
        assert row == t + [999_999] * (width - len(t))


def test_block_table_matrix_into_a_wider_view():
    out = np.full((4, 6), -7, dtype=np.int32)
    block_table_matrix([[3], [], [1, 2, 5]], pad=9, width=6, out=out[:3])
    assert out.tolist() == [[3, 9, 9, 9, 9, 9], [9] * 6, [1, 2, 5, 9, 9, 9], [-7] * 6]


def test_step_trace_records_every_step(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(path))
    eng = LLMEngine(EngineConfig(model="demo", block_size=4, max_model_len=64, max_num_seqs=4,
                                 max_num_batched_tokens=16, num_kv_blocks=24, show_progress=False))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", list(range(1, 21)), params)      # 20 tokens: two chunks of 16 and 4
    launched = 0
    while eng.has_unfinished():
        if launched == 2:
            eng.add_request("b", [7, 8, 9], params)        # joins decoding "a": a mixed step
        eng.step()
        launched += 1
    eng.shutdown()
    steps = read_trace(str(path))
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert steps[0]["kind"] == "prefill" and steps[0]["tokens"] == 16 and steps[0]["seqs"] == 1
    assert steps[1]["tokens"] == 4
    kinds = {s["kind"] for s in steps}
    assert kinds == {"prefill", "mixed", "decode"}
    # every token computed: 20 + 3 prompt tokens, then one per output token but the last of each
    assert sum(s["tokens"] for s in steps) == 20 + 3 + 2 * (5 - 1)
    for s in steps:
        assert s["decodes"] <= s["seqs"] <= s["tokens"]
        assert s["graph"] is False and "gpu_ms" not in s   # no GPU events on the CPU
        assert min(s["schedule_ms"], s["build_ms"], s["launch_ms"]) >= 0


def test_every_step_input_starts_16_byte_aligned():
    # Triton compiles a kernel per pointer alignment: a step's inputs must not move between aligned
    # and unaligned addresses with the step's sizes, or a kernel compiles mid-serving.
    import torch

    from tp_overlap_plugin.serving.model.attention import AttnMeta
    from tp_overlap_plugin.serving.worker.step_layout import _aligned_offsets
    for sizes in ([3, 5, 7], [1], [4, 4], [2, 9, 0, 1]):
        parts = [np.zeros(n) for n in sizes]
        for align in (2, 4):
            at = _aligned_offsets(parts, align)
            assert all(i % align == 0 for i in at) and at[-1] >= sum(sizes)
            assert all(at[k + 1] - at[k] >= sizes[k] for k in range(len(sizes)))   # no overlap
    packed = torch.zeros(64, dtype=torch.int32)
    for nd in range(4):
        cu = torch.arange(0, 12, 2, dtype=torch.int32)
        meta = AttnMeta(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=nd, cu_seqlens_q=cu,
                        context_lens=packed[5:10], block_tables=packed[12:32].view(5, 4), max_q_len=2)
        part = meta.prompt_part()
        assert meta.prompt_part() is part                         # built once a step, for every layer
        assert torch.equal(part[0], cu[nd:] - nd) and torch.equal(part[1], packed[5 + nd:10])
        assert torch.equal(part[2], packed[12:32].view(5, 4)[nd:])
        if nd:
            assert all(t.data_ptr() % 16 == 0 for t in part)


def test_step_trace_names_the_kernels_a_step_compiled(tmp_path, monkeypatch):
    # Triton's JIT cache hook runs before a kernel variant is built; the trace gives each step the
    # variants built while it was being launched, and none built between steps (warm-up, capture).
    import torch
    from triton import knobs

    from tp_overlap_plugin.serving.engine.step_trace import StepTrace
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    trace = StepTrace(str(tmp_path / "steps.jsonl"), torch.device("cpu"))

    class Batch:
        seqs, num_new, num_decodes = ["a", "b"], [5, 1], 1

    def compile_(name):
        return knobs.runtime.jit_cache_hook(key=None, repr=f"{name}[num_warps=4](stride_bt: i32)", fn=None,
                                            compile=None, is_manual_warmup=False, already_compiled=False)
    compile_("warm_up_kernel")
    for names in (["_prefill_kernel", "_decode_kernel"], []):
        trace.enter()
        rec = trace.start(Batch(), 0.0)
        assert all(compile_(n) is False for n in names)   # False: Triton goes on and compiles
        trace.end(rec, graph=False)
    trace.close()
    steps = read_trace(str(tmp_path / "steps.jsonl"))
    assert [s.get("compiles") for s in steps] == [["_prefill_kernel[num_warps=4](stride_bt: i32)",
                                                   "_decode_kernel[num_warps=4](stride_bt: i32)"], None]
