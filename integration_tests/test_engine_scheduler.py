"""Block manager and scheduler: refcounts, no leaks under aborts and preemption, recompute is exact."""

import random
from collections import Counter

import pytest

from tp_overlap_plugin.serving import EngineConfig, LLMEngine, SamplingParams
from tp_overlap_plugin.serving.engine.block_manager import BlockManager


def test_block_manager_refcounts_and_all_or_nothing():
    bm = BlockManager(num_blocks=6, block_size=4)
    a: list[int] = []
    assert bm.ensure(a, 9) and len(a) == 3 and bm.num_free == 3
    assert bm.ensure(a, 12) and len(a) == 3        # still fits in 3 blocks
    b: list[int] = []
    assert not bm.ensure(b, 17) and b == [] and bm.num_free == 3   # 5 blocks: refused, nothing taken
    c = bm.fork(a)
    assert c == a and all(bm.refcount[x] == 2 for x in a)
    bm.free(a)
    assert a == [] and bm.num_free == 3            # c still owns them
    bm.free(c)
    assert bm.num_free == 6 and all(r == 0 for r in bm.refcount)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free([0])


def _engine(**kw):
    base = dict(model="demo", block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=24,
                show_progress=False)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _run(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.timeout(120)
def test_preemption_recompute_gives_identical_greedy_output():
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(5, 25), ignore_eos=True) for _ in prompts]
    big = _engine(num_kv_blocks=400)
    ref = _run(big, prompts, params)
    assert big.scheduler.num_preemptions == 0
    small = _engine(num_kv_blocks=20)               # 80 token slots for ~10 sequences of up to 55 tokens
    got = _run(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert small.block_manager.num_free == 20
    big.shutdown()
    small.shutdown()


@pytest.mark.timeout(120)
def test_no_block_leaks_with_random_requests_aborts_and_preemption():
    rng = random.Random(1)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in (9, 16, 25)]
    eng = _engine(num_kv_blocks=24, max_num_batched_tokens=16)
    n_blocks = eng.block_manager.num_blocks
    live: set[str] = set()
    aborted = finished = 0
    next_id = 0
    for step in range(400):
        if next_id < 60 and rng.random() < 0.5:
            sp = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5]),
                                top_p=rng.choice([1.0, 0.8]), max_tokens=rng.randint(1, 30),
                                seed=rng.choice([None, 5]), ignore_eos=rng.random() < 0.5)
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.5:   # shared prefixes exercise the prefix cache under the same churn
                prompt = prefixes[rng.randrange(3)] + prompt
            eng.add_request(f"q{next_id}", prompt, sp)
            live.add(f"q{next_id}")
            next_id += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            out = eng.abort_request(victim)
            assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
            live.discard(victim)
            aborted += 1
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        owners = Counter(b for s in eng.scheduler.running + list(eng.scheduler.waiting) for b in s.block_table)
        bm = eng.block_manager
        assert n_blocks - bm.num_free == len(owners), f"step {step}: in use {n_blocks - bm.num_free}, owned {len(owners)}"
        assert all(bm.refcount[b] == c for b, c in owners.items()), f"step {step}: refcounts off"
        if next_id >= 60 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished() and not live
    assert aborted > 5 and finished > 20 and eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_cache_hits > 0
    assert eng.block_manager.num_free == n_blocks
    assert all(r == 0 for r in eng.block_manager.refcount)
    eng.shutdown()


def test_abort_frees_blocks_at_once_and_chunks_respect_the_budget():
    eng = _engine(num_kv_blocks=64, max_num_batched_tokens=8)
    eng.add_request("long", list(range(40)), SamplingParams(max_tokens=5))
    batch_sizes = []
    for _ in range(3):
        eng.step()
        batch_sizes.append(eng.scheduler.running[0].num_computed)
    assert batch_sizes == [8, 16, 24]   # chunked prefill, 8 tokens per step
    assert eng.block_manager.num_free == 64 - 6
    eng.abort_request("long")
    assert eng.block_manager.num_free == 64 and not eng.has_unfinished()
    assert eng.abort_request("long") is None   # unknown / already gone: no error, nothing happens
    eng.shutdown()


def test_prefix_cache_reuses_blocks_and_changes_nothing():
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(37)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in prompts]
    plain = _engine(num_kv_blocks=200, enable_prefix_caching=False)
    ref = _run(plain, prompts, params)
    assert plain.block_manager.num_cache_hits == 0
    eng = _engine(num_kv_blocks=200)
    first = _run(eng, prompts[:1], params[:1])
    assert eng.block_manager.num_cache_hits == 0
    computed = []
    real_step = eng.runner.execute
    eng.runner.execute = lambda step: (computed.append(len(step.input_ids)), real_step(step))[1]
    eng.add_request("again", prompts[0], params[0])
    while eng.has_unfinished():
        eng.step()
    # Every full 4-token block of the repeated prompt comes from the cache, short of its last token.
    hits = (len(prompts[0]) - 1) // 4
    assert hits >= 9 and eng.block_manager.num_cache_hits == hits
    assert computed[0] == len(prompts[0]) - 4 * hits
    eng.runner.execute = real_step
    got = _run(eng, prompts[1:], params[1:])
    assert [o.outputs[0].token_ids for o in first + got] == [o.outputs[0].token_ids for o in ref]
    # The others share the 9 full blocks of the 37-token common prefix.
    assert eng.block_manager.num_cache_hits == hits + 3 * 9
    assert eng.block_manager.num_free == 200 and all(r == 0 for r in eng.block_manager.refcount)
    # Cached blocks are reclaimed when the pool needs them: a pool of exactly one max-length sequence
    # still serves a different prompt after the cache filled it.
    small = _engine(num_kv_blocks=16)
    a = _run(small, [list(range(60))], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    b = _run(small, [list(range(100, 160))], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert a[0].finished and b[0].finished and small.block_manager.num_free == 16
    for e in (plain, eng, small):
        e.shutdown()


def test_sampler_distribution_matches_filtered_softmax():
    import torch

    from tp_overlap_plugin.serving.model.sampler import sample

    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    n = 40000

    def freqs(**kw):
        sp = SamplingParams(**kw, logprobs=True)
        toks, lps = sample(logits.repeat(n, 1), [sp] * n, [None] * n, torch.Generator().manual_seed(0))
        assert all(abs(lp - torch.log_softmax(logits, -1)[t].item()) < 1e-5 for t, lp in zip(toks[:50], lps[:50]))
        # without logprobs asked for, the same draws and no logprobs computed
        plain, none = sample(logits.repeat(n, 1), [SamplingParams(**kw)] * n, [None] * n,
                             torch.Generator().manual_seed(0))
        assert plain == toks and none == [None] * n
        return torch.bincount(torch.tensor(toks), minlength=6).float() / n

    def expect(temp, keep):
        p = torch.softmax(logits / temp, -1) * torch.tensor(keep, dtype=torch.float32)
        return p / p.sum()

    t = 0.7
    p = torch.softmax(logits / t, -1)
    cases = [
        (dict(temperature=t), [1] * 6),
        (dict(temperature=t, top_k=3), [1, 1, 1, 0, 0, 0]),
        # top_p: keep the smallest prefix (by rank) whose mass reaches top_p.
        (dict(temperature=t, top_p=float(p[:2].sum()) + 1e-3), [1, 1, 1, 0, 0, 0]),
        (dict(temperature=t, min_p=0.3), [int(x >= 0.3 * p.max()) for x in p]),
    ]
    greedy, lp = sample(logits.repeat(3, 1), [SamplingParams(temperature=0)] * 3, [None] * 3, torch.Generator())
    assert greedy == [0, 0, 0] and lp == [None] * 3
    greedy, lp = sample(logits.repeat(2, 1), [SamplingParams(temperature=0, logprobs=True)] * 2, [None] * 2,
                        torch.Generator())
    assert greedy == [0, 0] and abs(lp[0] - torch.log_softmax(logits, -1)[0].item()) < 1e-6
    for kw, keep in cases:
        got, want = freqs(**kw), expect(t, keep)
        assert (got - want).abs().max() < 0.012, (kw, got, want)


def test_cpu_kv_budget_sets_the_pool_size():
    from tp_overlap_plugin.serving import EngineConfig as EC

    eng = LLMEngine(EC(model="demo", block_size=4, max_model_len=64, kv_cache_bytes=3 << 20, show_progress=False))
    per_block = eng.runner.kv_bytes_per_block()
    assert per_block == 2 * 2 * 4 * 2 * 32 * 4          # k+v, layers, block, kv heads, head_dim, fp32
    assert eng.block_manager.num_blocks == (3 << 20) // per_block
    eng.shutdown()
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(EC(model="demo", block_size=4, max_model_len=64, kv_cache_bytes=per_block * 8, show_progress=False))
