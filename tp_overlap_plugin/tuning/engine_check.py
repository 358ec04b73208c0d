"""The last phase of `tp-overlap tune`: the engine's verdict. Every other phase times one op at a time;
what users get is the engine's step, so this one builds the engine at the run's TP size for its model
(dummy weights) twice, the stock layers and the flag's on the tables just written, and times real
steps of both, interleaved, in repeats:

  prefill  a step of the token budget (vLLM's 8192 by default) and one of 2048 tokens, of fresh
           prompts of PROMPT_LEN tokens (e2e.py's prefill scenarios);
  decode   batches of 1, 16 and 64 sequences of DECODE_CONTEXT tokens each, in the whole-step CUDA graphs
           the engine serves them from (steps that fit a piecewise bucket run in it, as served).

Steps are launched back to back and the device waited for at the end, as the engine serves them with
async scheduling (the host builds step i+1 while step i runs). A step size where the flag's step lost
(rules.step_verdict: it must win by rules.ENGINE_MARGIN in every repeat) and was sequence-parallel is
timed once more with the flag's ops in the replicated layout (the flag's engine built again on a table
that says so at those sizes); where that loses too, the size runs stock. The rows go into the store
(phase "engine"), and from there into the dispatch table's "engine" rows, which the layers (overlap_
layers.begin_step) and the vLLM plugin honour through Dispatcher.step_runs.

A row is measured again when the tables it ran on change (its fingerprint) or with --force. On the
CPU (the interpreter) the demo model at the smallest sizes runs the whole procedure eagerly, one
repeat by wall clock: a check of the logic, not a measurement. TP_OVERLAP_TUNE_FAKE_STEP_MS (a test
hook: {"<kind>/<tokens>": {"stock" | "flag" | "replicated": ms}}) reports those times for the steps it
names, which still run.
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
TARGET_S = 0.3          # a measurement's steps run about this long on a GPU
MAX_CALLS = 64
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


def fingerprint(device_name: str, world: int) -> str:
    """What the flag's steps ran on: the dispatch table's per-op rows and the config tables in the cache
    (not the verdict, dates or provenance)."""
    parts = []
    for kind, w in (("dispatch", world), ("gemm", None), ("decode", None)):
        data = tables.read(kind, device_name, w) or {}
        drop = ("engine", "engine_margin", "date", "command", "models", "tuned_by", "source")
        parts.append({k: v for k, v in data.items() if k not in drop})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def todo(plan, device_name: str, stored: dict, force: bool) -> list[dict]:
    """The plan's step sizes the store lacks under this fingerprint (all of them with --force)."""
    fp = fingerprint(device_name, plan.world)
    return [it for it in plan.items.get("engine", [])
            if force or stored.get(it["key"], {}).get("fingerprint") != fp]


# ---- the ranks ----------------------------------------------------------------------------------

def engine_rank(ctx, plan, items: list, table_path: str, fp: str, deadline: float, cache: str):
    """One rank of the engine phase: both engines built, the steps of `items` timed, stock against the
    flag. Returns rank 0's rows ({key: row}), what stopped it (None: nothing) and its environment."""
    import torch
    os.environ["TP_OVERLAP_CACHE"] = cache
    from tp_overlap_plugin.tuning import rules
    from tp_overlap_plugin.multirank import agree
    from tp_overlap_plugin.tuning.store import environment
    env = environment(plan)
    items = _fitted(items, _max_len(plan))
    t0 = time.monotonic()
    stock = _runner(ctx, plan, None)
    if ctx.device.type == "cuda":
        # the flag's engine is a second copy of the model: it must fit beside the stock one
        need = 1.2 * torch.cuda.memory_reserved(ctx.device)
        free = _min_over_ranks(ctx, torch.cuda.mem_get_info(ctx.device)[0])
        if free < need:
            stock.release()
            return {}, (f"the flag's engine ({need / 2**30:.1f} GiB a rank, as much as the stock one) does not fit "
                        f"beside the stock engine ({free / 2**30:.1f} GiB free): the engine check did not run; "
                        f"run it at a larger TP size"), env
    flag = _runner(ctx, plan, table_path)
    built_s = time.monotonic() - t0
    layouts = _layouts(plan, table_path)
    rows, stopped = {}, None
    for it in items:
        if not agree(ctx, time.time() < deadline if ctx.rank == 0 else None):
            stopped = "the time budget ran out"
            break
        step = _step(it, plan.dims.vocab)
        times = _interleaved(ctx, plan, it, step, {"stock": stock, "flag": flag})
        rows[it["key"]] = {"model": plan.model, "kind": it["kind"], "tokens": it["tokens"], "budget": it["budget"],
                           "shapes": [list(s) for s in _ops(plan)], "layout": layouts[it["tokens"]],
                           "fingerprint": fp, **_recorded(times)}
    # the layout first, then the ops: a sequence-parallel step that lost, once more replicated
    again = agree(ctx, [k for k, r in rows.items() if rules.step_verdict(r, plan.engine_margin) != "flag"
                        and r["layout"] == "sharded"] if ctx.rank == 0 else None)
    if again and stopped is None:
        flag.release()
        flag = None  # its weights go before the next engine's come
        _free()
        flag = _runner(ctx, plan, _provisional(table_path, [rows[k] for k in again]))
        for it in (it for it in items if it["key"] in again):
            times = _interleaved(ctx, plan, it, _step(it, plan.dims.vocab), {"stock": stock, "replicated": flag})
            # this round's own stock times: its ratios are taken against them, repeat by repeat
            rows[it["key"]].update(_recorded({"replicated": times["replicated"], "replicated_stock": times["stock"]}))
    flag.release()
    stock.release()
    for r in rows.values():
        r["build_s"] = built_s
    return (rows if ctx.rank == 0 else {}), stopped, env


def _ops(plan) -> list[tuple]:
    return sorted({(LAYER_OPS[layer], k, n) for layer, k, n in plan.dims.layers(plan.world)})


def _layouts(plan, table_path: str) -> dict:
    """The flag's layout per measured step size, by the table it runs on (sequence-parallel: "sharded")."""
    from tp_overlap_plugin.dispatch import Dispatcher
    W = plan.world
    d = Dispatcher.load("table", world=W, path=table_path)
    return {it["tokens"]: "sharded" if W > 1 and d.sequence_parallel(-(-it["tokens"] // W) * W, _ops(plan))
            else "replicated" for it in plan.items["engine"]}


def _provisional(table_path: str, lost: list[dict]) -> str:
    """A copy of the table whose verdict runs the flag's ops replicated at the step sizes that lost."""
    table = tables.read("dispatch", path=table_path)
    table["engine"] = [{"M": r["tokens"], "shapes": r["shapes"], "runs": "replicated"} for r in lost]
    return str(tables.write("dispatch", table["device"], table["world"], table, path=f"{table_path}.replicated.json"))


def _runner(ctx, plan, table_path: str | None):
    """The engine's model runner on this rank (the stock layers, or the flag's on `table_path`), which
    every rank drives with the same steps: no step messages between them."""
    from tp_overlap_plugin.serving.config import EngineConfig
    from tp_overlap_plugin.options import TPOverlapOptions
    from tp_overlap_plugin.serving.worker.piecewise import DEFAULT_MAX_GRAPH_TOKENS, graph_token_limit
    from tp_overlap_plugin.serving.worker.runner import ModelRunner
    max_len = _max_len(plan)
    items = _fitted(plan.items["engine"], max_len)
    budget = items[0]["budget"]
    decode = [it for it in items if it["kind"] == "decode"]
    blocks = max(max(sum(map(len, _step(it, 2).block_tables)) for it in items), -(-max_len // BLOCK)) + 1
    # each engine as served: the flag with its fused-op design and the step sizes it runs in graphs (all
    # of them with the chunked ops), stock with the default graph sizes
    overlap = {"fused_ops": plan.fused_ops, **({"dispatch_table": table_path} if table_path is not None else {})}
    limit = (graph_token_limit(TPOverlapOptions(fused_ops=plan.fused_ops), plan.world) if table_path is not None
             else DEFAULT_MAX_GRAPH_TOKENS)
    graphs = [t for t in (it["tokens"] for it in items if it["kind"] == "prefill") if t <= min(budget, limit)]
    cfg = EngineConfig(model=plan.model_spec, load_format="dummy", tensor_parallel_size=plan.world,
                       device=plan.device, dtype="auto" if plan.device == "cuda" else "float16",
                       max_model_len=max_len, max_num_seqs=max(it["tokens"] for it in decode),
                       max_num_batched_tokens=budget, block_size=BLOCK, num_kv_blocks=blocks,
                       enable_prefix_caching=False, cuda_graph_batch_sizes=[it["tokens"] for it in decode],
                       piecewise_graph_token_counts=graphs or None, piecewise_cuda_graphs=bool(graphs),
                       show_progress=False,
                       tp_overlap=overlap if table_path is not None else None)
    runner = ModelRunner(cfg, ctx.rank, plan.world, ctx.device_group, ctx.group, ctx.device)
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
    """Per variant, ms per step in each of the plan's repeats, the variants taking turns in each."""
    from tp_overlap_plugin.multirank import agree
    fake = options.env_tune_fake_step_ms().get(f"{it['kind']}/{it['tokens']}", {})
    calls = 1  # the interpreter: one step each, nothing to warm up
    if ctx.device.type == "cuda":
        for runner in runners.values():  # compiles what is left, and the estimate of a step's time
            _run_steps(ctx, runner, step, 1)
        est = max(_run_steps(ctx, runner, step, 1) for runner in runners.values())
        calls = agree(ctx, max(2, min(MAX_CALLS, math.ceil(1e3 * TARGET_S / max(est, 1e-3)))))
    times = {name: [] for name in runners}
    for _ in range(plan.repeats):
        for name, runner in runners.items():
            ms = _run_steps(ctx, runner, step, calls)
            times[name].append(float(fake.get(name, ms)))
    return agree(ctx, times if ctx.rank == 0 else None)


def _recorded(times: dict) -> dict:
    """`<variant>_ms` (the median over repeats) and `<variant>_ms_repeats` per variant."""
    import statistics
    out = {}
    for name, ts in times.items():
        out[f"{name}_ms"] = statistics.median(ts)
        out[f"{name}_ms_repeats"] = ts
    return out
