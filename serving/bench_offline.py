"""Offline engine benchmarks (vLLM's `bench throughput` / `bench latency` in spirit), timed at the
engine's step loop so that TTFT and TPOT are per request:

    tp-overlap bench throughput --model llama-3-8b --load-format dummy --tp 2 --input-len 128 \
        --output-len 512 --num-prompts 64 [--tp-overlap]
    tp-overlap bench latency   --model llama-3-8b --load-format dummy --tp 2 --batch-size 1

Prompts are random token ids (seeded), `ignore_eos`, greedy: every request produces exactly
`output_len` tokens, so runs with and without `--tp-overlap` do the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from .config import EngineConfig, SamplingParams
from .engine import LLM


def random_prompts(vocab: int, n: int, input_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the lowest ids, which small tokenizers use for specials
    return torch.randint(min(10, vocab - 1), vocab, (n, input_len), generator=g).tolist()


def run_batch(llm: LLM, prompts: list[list[int]], output_len: int, max_concurrency: Optional[int] = None) -> dict:
    """Submit `prompts` (all at once, or keeping at most `max_concurrency` in flight) and time them."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pending = list(prompts)
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens: dict[str, int] = {}
    limit = max_concurrency or len(prompts)
    t0 = time.perf_counter()

    def submit():
        while pending and len(submitted) - len(finished) < limit:
            seq = engine.make_sequence(None, pending.pop(0), params)
            submitted[seq.request_id] = time.perf_counter()
            engine.add_sequence(seq)

    submit()
    while len(finished) < len(prompts):
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            tokens[o.request_id] = n
            if o.finished:
                finished[o.request_id] = now
        submit()
    elapsed = time.perf_counter() - t0
    ttft = [first[r] - submitted[r] for r in submitted]
    tpot = [(finished[r] - first[r]) / (tokens[r] - 1) for r in submitted if tokens[r] > 1]
    out_tokens = sum(tokens.values())
    in_tokens = sum(len(p) for p in prompts)
    return {"num_requests": len(prompts), "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": out_tokens / elapsed, "total_tokens_per_s": (out_tokens + in_tokens) / elapsed,
            "ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot)}


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(x * 1e3 for x in xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def scenario(llm: LLM, batch: int, input_len: int, output_len: int, seed: int = 0, warmup: bool = True) -> dict:
    vocab = llm.engine.mcfg.vocab_size
    if warmup:
        # The same batch and prompt length, two tokens each: every step shape the measured run takes
        # (the prefill chunks, the decode batch) has compiled its kernels and settled its allocations.
        # A smaller warm-up left a 5 s Triton compile inside one measured TTFT on H200x2.
        run_batch(llm, random_prompts(vocab, batch, input_len, seed + 1), 2)
    res = run_batch(llm, random_prompts(vocab, batch, input_len, seed), output_len)
    res.update(batch=batch, input_len=input_len, output_len=output_len)
    return res


def add_bench_offline_subcommands(bench_sub) -> None:
    """`throughput` and `latency` under `tp-overlap bench`."""
    from .cli import add_engine_args

    t = bench_sub.add_parser("throughput", help="offline throughput: num-prompts random requests at once")
    add_engine_args(t)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--output-json", default=None)
    t.set_defaults(func=_main, mode="throughput")
    lat = bench_sub.add_parser("latency", help="one batch, end to end, repeated: TTFT and decode step time")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--iters", type=int, default=3)
    lat.add_argument("--output-json", default=None)
    lat.set_defaults(func=_main, mode="latency")


def _main(args: argparse.Namespace) -> int:
    from .cli import engine_config_from_args

    cfg: EngineConfig = engine_config_from_args(args)
    with LLM(cfg) as llm:
        if not llm.is_driver:
            return 0
        if args.mode == "throughput":
            res = scenario(llm, args.num_prompts, args.input_len, args.output_len, cfg.seed)
        else:
            runs = [scenario(llm, args.batch_size, args.input_len, args.output_len, cfg.seed + i, warmup=i == 0)
                    for i in range(args.iters)]
            res = {"runs": runs, "median_elapsed_s": statistics.median(r["elapsed_s"] for r in runs),
                   "median_tpot_ms": statistics.median(r["tpot_ms"]["median"] for r in runs),
                   "median_ttft_ms": statistics.median(r["ttft_ms"]["median"] for r in runs)}
    res["config"] = json.loads(cfg.model_dump_json())
    print(json.dumps(res, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
