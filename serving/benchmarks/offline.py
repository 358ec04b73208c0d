"""Offline engine benchmarks (vLLM's `bench throughput` / `bench latency` in spirit), timed at the
engine's step loop so that TTFT and TPOT are per request:

    tp-overlap bench throughput --model llama-3-8b --load-format dummy --tp 2 --input-len 128 \
        --output-len 512 --num-prompts 64 [--tp-overlap]
    tp-overlap bench latency   --model llama-3-8b --load-format dummy --tp 2 --batch-size 1
    tp-overlap bench throughput --model llama-3-8b --load-format dummy --tp 2 --dataset lognormal \
        --input-len 256 --output-len 128 --num-prompts 256 --max-concurrency 64 --min-seconds 15

Prompts are random token ids (seeded), `ignore_eos`, greedy: every request produces exactly
`output_len` tokens, so runs with and without `--tp-overlap` do the same work. `--dataset lognormal`
draws long-tailed lengths instead (serving/benchmarks/workloads.py), the same list for the same --seed.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from ..config import EngineConfig, SamplingParams
from ..engine.llm import LLM
from .workloads import lognormal_lengths


def random_prompts(vocab: int, n: int, input_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the lowest ids, which small tokenizers use for specials
    return torch.randint(min(10, vocab - 1), vocab, (n, input_len), generator=g).tolist()


def _prompts_of(vocab: int, input_lens: list[int], seed: int) -> list[list[int]]:
    rows = random_prompts(vocab, len(input_lens), max(input_lens), seed)
    return [r[:n] for r, n in zip(rows, input_lens)]


@dataclass
class _Run:
    num_requests: int
    elapsed: float
    in_tokens: int
    out_tokens: int
    ttft: list[float]
    tpot: list[float]


def _timed_run(llm: LLM, prompts: list[list[int]], output_lens: Union[int, list[int]],
               max_concurrency: Optional[int] = None) -> _Run:
    engine = llm.engine
    if isinstance(output_lens, int):
        output_lens = [output_lens] * len(prompts)
    pending = list(zip(prompts, output_lens))
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    tokens: dict[str, int] = {}
    limit = max_concurrency or len(prompts)
    t0 = time.perf_counter()

    def submit():
        while pending and len(submitted) - len(finished) < limit:
            prompt, n_out = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
            request = engine.process_request(prompt, params)
            submitted[engine.add(None, request)] = time.perf_counter()

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
    return _Run(len(prompts), time.perf_counter() - t0, sum(len(p) for p in prompts), sum(tokens.values()),
                [first[r] - submitted[r] for r in submitted],
                [(finished[r] - first[r]) / (tokens[r] - 1) for r in submitted if tokens[r] > 1])


def _report(runs: list[_Run]) -> dict:
    n = sum(r.num_requests for r in runs)
    elapsed = sum(r.elapsed for r in runs)
    out_tokens = sum(r.out_tokens for r in runs)
    res = {"num_requests": n, "elapsed_s": elapsed, "requests_per_s": n / elapsed,
           "output_tokens_per_s": out_tokens / elapsed,
           "total_tokens_per_s": (out_tokens + sum(r.in_tokens for r in runs)) / elapsed,
           "ttft_ms": _summary([x for r in runs for x in r.ttft]),
           "tpot_ms": _summary([x for r in runs for x in r.tpot])}
    if len(runs) > 1:
        # the spread of rounds within one process: noise the pairs cannot be blamed for
        res.update(rounds=len(runs), round_output_tokens_per_s=[r.out_tokens / r.elapsed for r in runs])
    return res


def run_batch(llm: LLM, prompts: list[list[int]], output_len: Union[int, list[int]],
              max_concurrency: Optional[int] = None) -> dict:
    """Submit `prompts` (all at once, or keeping at most `max_concurrency` in flight) and time them."""
    return _report([_timed_run(llm, prompts, output_len, max_concurrency)])


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(x * 1e3 for x in xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def measure(llm: LLM, lengths: list[tuple[int, int]], seed: int = 0, *, max_concurrency: Optional[int] = None,
            min_seconds: float = 0.0, max_requests: Optional[int] = None, warmup: bool = True,
            warmup_output_len: Optional[int] = 2) -> dict:
    """Rounds of the requests `lengths` ((input, output) per request) until the measured time reaches
    min_seconds or, given max_requests, the requests do; one round when both are 0/None.

    Every round has the same lengths and fresh prompt ids (the prefix cache must not turn a round's
    prefill into hits). The engine schedules by token counts, not by the clock, so with a fixed KV pool
    each round takes the same steps in every engine, and rates compare however many rounds each ran.
    warmup_output_len None: the warm-up is a whole round (outputs at full length)."""
    vocab = llm.engine.mcfg.vocab_size
    ins = [i for i, _ in lengths]
    outs = [o for _, o in lengths]
    if warmup:
        # The same prompts' shapes with outputs cut short: every step shape the measured rounds take
        # (the prefill chunks, prefill mixed with decodes, the decode batches) has compiled its kernels
        # and settled its allocations. A smaller warm-up left a 5 s Triton compile inside one measured
        # TTFT on H200x2.
        _timed_run(llm, _prompts_of(vocab, ins, seed + 1),
                   outs if warmup_output_len is None else [min(o, warmup_output_len) for o in outs], max_concurrency)
    runs: list[_Run] = []
    while True:
        round_seed = seed if not runs else seed + 1 + len(runs)
        runs.append(_timed_run(llm, _prompts_of(vocab, ins, round_seed), outs, max_concurrency))
        if sum(r.elapsed for r in runs) >= min_seconds:
            break
        if max_requests and sum(r.num_requests for r in runs) >= max_requests:
            break
    return _report(runs)


def scenario(llm: LLM, batch: int, input_len: int, output_len: int, seed: int = 0, warmup: bool = True,
             **kw) -> dict:
    """`batch` requests of one length; keywords as `measure`'s."""
    res = measure(llm, [(input_len, output_len)] * batch, seed, warmup=warmup, **kw)
    res.update(batch=batch, input_len=input_len, output_len=output_len)
    return res


@dataclass(frozen=True)
class OfflineBenchConfig:
    """What `bench throughput` / `bench latency` run (the engine is the EngineConfig beside it)."""
    mode: Literal["throughput", "latency"] = "throughput"
    input_len: int = 128          # prompt tokens per request (lognormal: the median)
    output_len: int = 128         # output tokens per request (lognormal: the median)
    # throughput
    num_prompts: int = 64         # requests per round
    dataset: Literal["fixed", "lognormal"] = "fixed"
    lognormal_sigma: float = 1.0
    max_concurrency: Optional[int] = None
    min_seconds: float = 0.0      # repeat the round (fresh prompts) until this much time is measured
    # latency
    batch_size: int = 1
    iters: int = 3                # times the batch runs (the first warms up)
    output_json: Optional[str] = None


def format_table(res: dict) -> str:
    """The human-readable summary of a throughput or latency result (the JSON has everything)."""
    if "runs" in res:    # latency
        r0 = res["runs"][0]
        rows = [("Batch size", r0["batch"]), ("Input / output tokens", f"{r0['input_len']} / {r0['output_len']}"),
                ("Iterations", len(res["runs"])),
                ("Median elapsed (s)", f"{res['median_elapsed_s']:.3f}"),
                ("Median TTFT (ms)", f"{res['median_ttft_ms']:.2f}"),
                ("Median TPOT (ms)", f"{res['median_tpot_ms']:.2f}")]
        title = "tp-overlap bench latency"
    else:
        rows = [("Requests", res["num_requests"]), ("Elapsed (s)", f"{res['elapsed_s']:.2f}"),
                ("Request throughput (req/s)", f"{res['requests_per_s']:.2f}"),
                ("Output throughput (tok/s)", f"{res['output_tokens_per_s']:.2f}"),
                ("Total throughput (tok/s)", f"{res['total_tokens_per_s']:.2f}")]
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
            for stat in ("mean", "median", "p99"):
                if stat in res[key]:
                    rows.append((f"{stat.capitalize()} {name} (ms)", f"{res[key][stat]:.2f}"))
        title = "tp-overlap bench throughput"
    lines = [f"{' ' + title + ' ':=^56}"] + [f"{k:<40}{v!s:>16}" for k, v in rows] + ["=" * 56]
    return "\n".join(lines)


def bench_offline_main(cfg: EngineConfig, bench: OfflineBenchConfig) -> int:
    """Run the benchmark on an engine of `cfg`, print the table, write the JSON where asked."""
    with LLM(cfg) as llm:
        if not llm.is_driver:
            return 0
        if bench.mode == "throughput" and bench.dataset == "lognormal":
            lengths = lognormal_lengths(bench.num_prompts, bench.input_len, bench.output_len, bench.lognormal_sigma,
                                        llm.engine.max_model_len, cfg.seed)
            res = measure(llm, lengths, cfg.seed, max_concurrency=bench.max_concurrency, min_seconds=bench.min_seconds)
            res.update(dataset="lognormal", input_lens=[i for i, _ in lengths], output_lens=[o for _, o in lengths])
        elif bench.mode == "throughput":
            res = scenario(llm, bench.num_prompts, bench.input_len, bench.output_len, cfg.seed,
                           max_concurrency=bench.max_concurrency, min_seconds=bench.min_seconds)
        else:
            runs = [scenario(llm, bench.batch_size, bench.input_len, bench.output_len, cfg.seed + i, warmup=i == 0)
                    for i in range(bench.iters)]
            res = {"runs": runs, "median_elapsed_s": statistics.median(r["elapsed_s"] for r in runs),
                   "median_tpot_ms": statistics.median(r["tpot_ms"].get("median", 0.0) for r in runs),
                   "median_ttft_ms": statistics.median(r["ttft_ms"]["median"] for r in runs)}
    res["config"] = json.loads(cfg.model_dump_json())
    print(format_table(res))
    if bench.output_json:
        with open(bench.output_json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {bench.output_json}")
    return 0
