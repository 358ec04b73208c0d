"""The last phase of `tp-overlap tune`: the engine's verdict. Every other phase times one op at a time;
what users get is the engine's step, so this one builds the engine at the run's TP size for its model
(dummy weights): the stock layers once, then in turn the flag's layers with each fused-op design
(options.DESIGNS, on a table of that design's per-op rows) and the flag's ops in the replicated
layout, and times real steps of each against the stock engine, interleaved, in repeats:

  prefill  a step of the token budget (vLLM's 8192 by default) and one of 2048 tokens, of fresh
           prompts of PROMPT_LEN tokens (e2e.py's prefill scenarios);
  decode   batches of 1, 16 and 64 sequences of DECODE_CONTEXT tokens each, in the whole-step CUDA graphs
           the engine serves them from (steps that fit a piecewise bucket run in it, as served).

A design's round times the step sizes where its table makes the layout sharded (elsewhere its step is
the replicated one); the replicated round times every size. Steps are launched back to back and the
device waited for at the end, as the engine serves them with async scheduling (the host builds step
i+1 while step i runs). The rules (rules.choose_design, step_verdict) then choose the design the engine
runs and, per step size, whether it runs that design sharded, the replicated layout, or stock. The rows
go into the store (phase "engine"), and from there into the dispatch table's "engine" rows, which the
layers (overlap_layers.begin_step) and the vLLM plugin honour through Dispatcher.step_runs.

A row is measured again when the tables it ran on change (its fingerprint) or with --force. On the
CPU (the interpreter) the demo model at the smallest sizes runs the whole procedure eagerly, one
repeat by wall clock: a check of the logic, not a measurement. TP_OVERLAP_TUNE_FAKE_STEP_MS (a test
hook: {"<kind>/<tokens>": {"stock" | "kernel" | "chunked" | "replicated": ms}}) reports those times for
the steps it names, which still run.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time

from tp_overlap_plugin import options, tables
from tp_overlap_plugin.shapes import LAYER_OPS

PROMPT_LEN = 2048       # prefill prompts (bench/e2e.py's prefill-b8/b32: 2048 tokens each)
PREFILL_TOKENS = 2048   # the prefill step measured beside the budget's
DECODE_BATCHES = (1, 16, 64)
# each decode sequence's context: e2e.py's decode scenarios (128 in, 512 out) average 128 + 256
DECODE_CONTEXT = 384
DEFAULT_BUDGET = 8192   # vLLM's default step budget, and bench/e2e.py's
TARGET_S = 0.6          # a repeat's steps run about this long per engine on a GPU
MAX_CALLS = 64
# A repeat is cut into turns of about TURN_S each, the engines taking turns in alternating order.
# One long run per engine read the TP=2 8192-token step 106-116 ms in all four variants, stock too,
# repeat to repeat (2026-11-28, H200x2: bench/notes/tune.md): a slow drift that a whole-repeat turn
# hands to whichever engine ran in it. Turns of one step each give both engines the same drift.
# A decode step's turn still holds many steps, so it is timed as served, launched back to back.
TURN_S = 0.05
BLOCK = 16              # KV block size (the engine's default)
# the interpreter: the demo model's smallest steps: the budget's (two prompts of 8 tokens) and half
# of it, as 8192 and 2048 on a GPU; batch 1
CPU_BUDGET, CPU_PROMPT_LEN, CPU_DECODE_BATCHES, CPU_CONTEXT = 16, 8, (1,), 8


def plan_items(model: str, world: int, device: str, budget: int | None) -> list[dict]:
    """The step sizes to check, each with its store key (model, kind, tokens)."""
    gpu = device == "cuda"
    budget = budget or (DEFAULT_BUDGET if gpu else CPU_BUDGET)
    prompt = PROMPT_LEN if gpu else CPU_PROMPT_LEN
    prefill = sorted({budget, min(budget, PREFILL_TOKENS) if gpu else max(1, budget // 2)}, reverse=True)
    items = [{"key": f"{model}/prefill/{t}", "kind": "prefill", "tokens": t, "prompt_len": prompt, "budget": budget}
             for t in prefill]
    items += [{"key": f"{model}/decode/{b}", "kind": "decode", "tokens": b, "context": DECODE_CONTEXT if gpu
               else CPU_CONTEXT, "budget": budget} for b in (DECODE_BATCHES if gpu else CPU_DECODE_BATCHES)]
    return items


def fingerprint(device_name: str, design_tables: dict) -> str:
    """What the flag's steps ran on: each design's dispatch table of per-op rows (tune._engine builds
    them from the store) and the config tables in the cache, not the verdict, dates or provenance. Of
    every design's rows, so that the verdict choosing a design (and the cached table then holding its
    rows) does not make the next run measure the verdict again."""
    drop = ("engine", "engine_margin", "date", "command", "models", "tuned_by", "source", "failed")
    parts = [VERDICT_FORMAT] + [{k: v for k, v in design_tables[d].items() if k not in drop} for d in sorted(design_tables)]
    for kind in ("gemm", "decode"):
        parts.append(tables.read(kind, device_name) or {})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# the store's engine rows as this module writes them: per design measured sharded `<design>_ms` and
# `<design>_stock_ms`, the replicated round's `replicated_ms` and `replicated_stock_ms`, `layouts`
VERDICT_FORMAT = "verdict-v2: per design"


def todo(plan, stored: dict, fp: str, force: bool) -> list[dict]:
    """The plan's step sizes the store lacks under this fingerprint (all of them with --force)."""
    return [it for it in plan.items.get("engine", [])
            if force or stored.get(it["key"], {}).get("fingerprint") != fp]


# ---- the ranks ----------------------------------------------------------------------------------

def engine_rank(ctx, plan, items: list, design_tables: dict, fp: str, deadline: float, cache: str):
    """One rank of the engine phase: the stock engine built, then in turn the flag's engine of each design
    ({design: table path}, per-op rows without a verdict) and the flag's ops in the replicated layout,
    each timed against the stock engine, step size by step size, interleaved. Returns rank 0's rows
    ({key: row}), what stopped it (None: nothing) and its environment."""
    import torch
    os.environ["TP_OVERLAP_CACHE"] = cache
    from tp_overlap_plugin.multirank import agree
    from tp_overlap_plugin.tuning.store import environment
    env = environment(plan)
    items = _fitted(items, _max_len(plan))
    t0 = time.monotonic()
    stock = _runner(ctx, plan, None, None, ())
    if ctx.device.type == "cuda":
        # the flag's engine is a second copy of the model: it must fit beside the stock one
        need = 1.2 * torch.cuda.memory_reserved(ctx.device)
        free = _min_over_ranks(ctx, torch.cuda.mem_get_info(ctx.device)[0])
        if free < need:
            stock.release()
            return {}, (f"the flag's engine ({need / 2**30:.1f} GiB a rank, as much as the stock one) does not fit "
                        f"beside the stock engine ({free / 2**30:.1f} GiB free): the engine check did not run; "
                        f"run it at a larger TP size"), env
    layouts = {d: _layouts(plan, path) for d, path in design_tables.items()}
    rows = {it["key"]: {"model": plan.model, "kind": it["kind"], "tokens": it["tokens"], "budget": it["budget"],
                        "shapes": [list(s) for s in _ops(plan)], "fingerprint": fp,
                        "layouts": {d: layouts[d][it["tokens"]] for d in design_tables}} for it in items}
    rounds = [(d, path, [it for it in items if layouts[d][it["tokens"]] == "sharded"])
              for d, path in design_tables.items()]
    # the replicated layout at every step size: decode's layout, and the fallback where no design's sharded
    # step wins (a table whose verdict runs "replicated" everywhere)
    first = next(iter(design_tables))
    rounds.append(("replicated", _provisional(design_tables[first], items, _ops(plan)), items))
    stopped, built_s = None, time.monotonic() - t0
    for name, path, todo_ in rounds:
        if not todo_:
            continue
        t1 = time.monotonic()
        design = first if name == "replicated" else name
        flag = _runner(ctx, plan, path, design, [it["tokens"] for it in todo_ if it["kind"] == "prefill"])
        built_s += time.monotonic() - t1
        for it in todo_:
            if not agree(ctx, time.time() < deadline if ctx.rank == 0 else None):
                stopped = "the time budget ran out"
                break
            times = _interleaved(ctx, plan, it, _step(it, plan.dims.vocab), {"stock": stock, name: flag})
            # each round's own stock times: its ratios are taken against them, repeat by repeat
            rows[it["key"]].update(_recorded({name: times[name], f"{name}_stock": times["stock"]}))
        flag.release()
        flag = None  # its weights go before the next engine's come
        _free()
        if stopped:
            break
    stock.release()
    # a step size is measured once every round that applies to it ran (the replicated one last)
    done = {k: r for k, r in rows.items() if "replicated_ms" in r}
    for r in done.values():
        r["build_s"] = built_s
    return (done if ctx.rank == 0 else {}), stopped, env


def _ops(plan) -> list[tuple]:
    return sorted({(LAYER_OPS[layer], k, n) for layer, k, n in plan.dims.layers(plan.world)})


def _layouts(plan, table_path: str) -> dict:
    """The flag's layout per measured step size, by the table it runs on (sequence-parallel: "sharded")."""
    from tp_overlap_plugin.options import TPOverlapOptions
    from tp_overlap_plugin.overlap_plan import OverlapPlan
    W = plan.world
    d = OverlapPlan(TPOverlapOptions(dispatch_table=table_path), "cpu", W).dispatcher
    return {it["tokens"]: "sharded" if W > 1 and d.sequence_parallel(-(-it["tokens"] // W) * W, _ops(plan))
            else "replicated" for it in plan.items["engine"]}


def _provisional(table_path: str, items: list[dict], ops: list) -> str:
    """A copy of the table whose verdict runs the flag's ops replicated at every step size of `items`."""
    table = tables.read("dispatch", path=table_path)
    table["engine"] = [{"M": it["tokens"], "shapes": [list(s) for s in ops], "runs": "replicated"} for it in items]
    return str(tables.write("dispatch", table["device"], table["world"], table, path=f"{table_path}.replicated.json"))


def _runner(ctx, plan, table_path: str | None, design: str | None, graph_steps):
    """The engine's model runner on this rank (the stock layers, or the flag's of `design` on `table_path`),
    which every rank drives with the same steps: no step messages between them. Prefill steps in CUDA
    graphs as served: up to the default graph size, and `graph_steps` above it where the chunked design
    runs them sharded (serving/worker/piecewise.py)."""
    from tp_overlap_plugin.serving.config import EngineConfig
    from tp_overlap_plugin.serving.worker.piecewise import DEFAULT_MAX_GRAPH_TOKENS
    from tp_overlap_plugin.serving.worker.layer_factory import make_overlap_plan
    from tp_overlap_plugin.serving.worker.runner import ModelRunner
    max_len = _max_len(plan)
    items = _fitted(plan.items["engine"], max_len)
    budget = items[0]["budget"]
    decode = [it for it in items if it["kind"] == "decode"]
    blocks = max(max(sum(map(len, _step(it, 2).block_tables)) for it in items), -(-max_len // BLOCK)) + 1
    big = set(graph_steps) if design == "chunked" and table_path is not None else set()
    graphs = [t for t in (it["tokens"] for it in items if it["kind"] == "prefill")
              if t <= min(budget, DEFAULT_MAX_GRAPH_TOKENS) or t in big]
    cfg = EngineConfig(model=plan.model_spec, load_format="dummy", tensor_parallel_size=plan.world,
                       device=plan.device, dtype="auto" if plan.device == "cuda" else "float16",
                       max_model_len=max_len, max_num_seqs=max(it["tokens"] for it in decode),
                       max_num_batched_tokens=budget, block_size=BLOCK, num_kv_blocks=blocks,
                       enable_prefix_caching=False, cuda_graph_batch_sizes=[it["tokens"] for it in decode],
                       piecewise_graph_token_counts=graphs or None, piecewise_cuda_graphs=bool(graphs),
                       show_progress=False,
                       tp_overlap={"fused_ops": design, "dispatch_table": table_path} if table_path is not None else None)
    runner = ModelRunner(cfg, ctx.rank, plan.world, ctx.device_group, ctx.group, ctx.device,
                         make_overlap_plan(cfg, ctx.device, plan.world))
    runner.messages = None
    return runner


def _max_len(plan) -> int:
    """The engines' max_model_len: the budget at least (the flag's engine warms its kernels up to
    min(budget, max_model_len) tokens), within the model's positions."""
    from tp_overlap_plugin.serving.config import EngineConfig
    items = plan.items["engine"]
    need = max([items[0]["budget"]] + [it.get("prompt_len", 0) for it in items]
               + [it.get("context", 0) + 1 for it in items])
    return min(EngineConfig(model=plan.model_spec).load_model_config().max_position_embeddings, need)


def _fitted(items: list, max_len: int) -> list:
    """The items with prompts and contexts within the model's positions."""
    return [{**it, "prompt_len": min(it["prompt_len"], max_len)} if it["kind"] == "prefill"
            else {**it, "context": min(it["context"], max_len - 1)} for it in items]


def _free() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _min_over_ranks(ctx, value: int) -> int:
    import torch
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.group)
    return int(t.item())


def _step(it: dict, vocab: int):
    """The step of an item, alike on every rank (seeded): fresh prompts filling `tokens`, or a decode
    batch; every sequence its own KV blocks."""
    import numpy as np

    from tp_overlap_plugin.serving.worker.runner import StepInput
    rng = np.random.default_rng(it["tokens"])
    if it["kind"] == "prefill":
        p = it["prompt_len"]
        q = [p] * (it["tokens"] // p) + ([it["tokens"] % p] if it["tokens"] % p else [])
        ctx = q
        rows = list(np.cumsum(q) - 1)
    else:
        q, ctx = [1] * it["tokens"], [it["context"]] * it["tokens"]
        rows = list(range(it["tokens"]))
    tables_, nxt = [], 0
    for c in ctx:
        n = -(-c // BLOCK)
        tables_.append(list(range(nxt, nxt + n)))
        nxt += n
    ids = rng.integers(0, vocab, size=sum(q)).tolist()
    return StepInput(input_ids=ids, q_lens=q, context_lens=list(ctx), block_tables=tables_,
                     num_decodes=0 if it["kind"] == "prefill" else len(q), logit_rows=[int(r) for r in rows])


def _run_steps(ctx, runner, step, calls: int) -> float:
    """ms per step of `calls` steps launched back to back (as async scheduling serves them), the
    ranks starting together."""
    import torch
    import torch.distributed as dist
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    for _ in range(calls):
        runner.execute(step)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return 1e3 * (time.perf_counter() - t0) / calls


def _interleaved(ctx, plan, it: dict, step, runners: dict) -> dict:
    """Per variant, ms per step in each of the plan's repeats. A repeat is a series of turns, the
    variants taking turns in each, in alternating order (A B, B A, ...); a repeat's ms per step is
    its turns' time over its steps."""
    from tp_overlap_plugin.multirank import agree
    fake = options.env_tune_fake_step_ms().get(f"{it['kind']}/{it['tokens']}", {})
    calls, per_turn = 1, 1  # the interpreter: one step each, nothing to warm up
    if ctx.device.type == "cuda":
        for runner in runners.values():  # compiles what is left, and the estimate of a step's time
            _run_steps(ctx, runner, step, 1)
        est = max(_run_steps(ctx, runner, step, 1) for runner in runners.values())
        calls, per_turn = agree(ctx, _turns(est))
    names = list(runners)
    times = {name: [] for name in names}
    for _ in range(plan.repeats):
        total = dict.fromkeys(names, 0.0)
        for turn in range(calls // per_turn):
            for name in (names if turn % 2 == 0 else names[::-1]):
                total[name] += _run_steps(ctx, runners[name], step, per_turn) * per_turn
        for name in names:
            times[name].append(float(fake.get(name, total[name] / calls)))
    return agree(ctx, times if ctx.rank == 0 else None)


def _turns(est_ms: float) -> tuple[int, int]:
    """(steps per repeat, steps per turn) for a step of about `est_ms`: a repeat of about TARGET_S
    (at least 2 steps, at most MAX_CALLS), turns of about TURN_S (at least one step); the repeat a
    whole number of turns, and at least two of them, so that both orders run."""
    per_turn = max(1, math.ceil(1e3 * TURN_S / max(est_ms, 1e-3)))
    calls = max(2, min(MAX_CALLS, math.ceil(1e3 * TARGET_S / max(est_ms, 1e-3))))
    turns = max(2, calls // per_turn)
    per_turn = max(1, min(per_turn, calls // 2))
    return turns * per_turn, per_turn


def _recorded(times: dict) -> dict:
    """`<variant>_ms` (the median over repeats) and `<variant>_ms_repeats` per variant."""
    import statistics
    out = {}
    for name, ts in times.items():
        out[f"{name}_ms"] = statistics.median(ts)
        out[f"{name}_ms_repeats"] = ts
    return out
