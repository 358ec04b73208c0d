"""Where a decode step's time goes, against the memory floor (issue 16).

    python bench/decode_profile.py --model llama-3-8b --tp 1                      # batches 1, 64, 256
    python bench/decode_profile.py --model llama-3-8b --tp 2 --batch 1,256
    python bench/decode_profile.py --model llama-3-8b --tp 1 --attention-only --attention-sweep
    python bench/decode_profile.py --model demo --device cpu --batch 1,4 --steps 4   # logic check on the CPU

One engine (dummy weights, CUDA graphs for exactly the measured batch sizes) in this process. Per
batch size B and per scheduling mode (synchronous, and async scheduling: step i+1 launched before
step i's tokens reach the host), B requests are prefilled to --context tokens minus the steps to come,
so the measured steps sit around --context tokens per sequence. Then:
  * step time: wall time of --steps engine.step() calls, each a pure decode of B sequences (median);
  * kernels: torch.profiler (CUDA activity) over --profile-steps further steps, every kernel put into
    attention / GEMM / all-reduce+comm / norm+rope+act / sampling / memcpy / other, ms per step;
  * GPU busy: the union of those kernels' intervals per step; host exposed = step time - GPU busy,
    the time the GPU waited for the host (at TP>1, a worker's lateness shows as all-reduce time);
  * at TP=1, the captured graph replayed back to back: the model's GPU time alone;
  * the floor: (this rank's weights + the live KV cache it reads) / HBM bandwidth, the bandwidth of
    a large device-to-device copy measured in the same run (bytes read + written).
The attention section times the paged decode kernel alone at the same shapes (and the previous
one-program-per-query-head kernel, kept here as the baseline), in GB/s of K/V read; --attention-sweep
adds its tile / warp / stage / split variants.

JSON + markdown in bench/results/ (decode-profile-<model>-tp<N>-<device>-<date>[-<tag>]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (RESULTS_DIR, environment, hbm_copy_bandwidth, log, md_table, time_per_call_ms,  # noqa: E402
                      write_results)

SCHEMA = "decode-profile/1"
CATEGORIES = ("attention", "GEMM", "all-reduce/comm", "norm/rope/act", "sampling", "memcpy/memset", "other")
# Matched in this order against the lower-cased kernel name; the first hit decides.
_PATTERNS = (
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel", "attention", "flash")),
    ("all-reduce/comm", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                         "reducescatter", "cross_device", "multimem", "one_shot", "two_shot", "barrier",
                         "symm_mem")),
    ("norm/rope/act", ("rmsnorm", "rope", "silu", "layer_norm", "layernorm")),
    ("sampling", ("argmax", "argmin", "softmax", "sort", "exponential", "topk", "multinomial")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_", "sm80_", "splitk",
              "ampere_", "hopper_", "_mm_")),
)


def categorize(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy/memset"
    low = name.lower()
    for category, pats in _PATTERNS:
        if any(p in low for p in pats):
            return category
    return "other"


def merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The union of [start, end) intervals as disjoint [start, end] pieces in order."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) intervals given in µs."""
    return sum(e - s for s, e in merged(intervals)) / 1e3


def device_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def kernel_breakdown(events: list[dict], steps: int) -> dict:
    per_cat = {c: 0.0 for c in CATEGORIES}
    by_name: dict[str, list[float]] = {}
    for e in events:
        per_cat[categorize(e["name"], e["cat"])] += e["dur"] / 1e3
        by_name.setdefault(e["name"], []).append(e["dur"] / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "ms_per_step": {c: v / steps for c, v in per_cat.items()},
        "gpu_busy_ms_per_step": union_ms([(e["ts"], e["ts"] + e["dur"]) for e in events]) / steps,
        "kernels_per_step": len(events) / steps,
        "top_kernels": [{"name": n[:160], "category": categorize(n, "kernel"), "ms_per_step": sum(d) / steps,
                         "calls_per_step": len(d) / steps} for n, d in top],
    }


# ---- the engine ---------------------------------------------------------------------------------

def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options of a script that profiles one engine's steps (this one, prefill_profile.py)."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tp-overlap", action="store_true", help="the flag's layers instead of stock")
    p.add_argument("--dispatch", default="table", choices=["table", "overlap", "stock"])
    p.add_argument("--dispatch-table", default=None, metavar="JSON",
                   help="a dispatch table to use instead of the shipped one (a candidate, before it ships)")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "kernel", "chunked"],
                   help="the sharded layout's AG-GEMM / GEMM-RS (tp_overlap.fused_ops; auto: the table's design)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=RESULTS_DIR)


def overlap_config(args) -> dict | None:
    """The engine's tp_overlap option from add_engine_args' flags (None: the stock layers)."""
    if not args.tp_overlap:
        return None
    return {"dispatch": args.dispatch, "dispatch_table": args.dispatch_table, "fused_ops": args.fused_ops}


def resolve_device(args) -> None:
    """--device auto -> cuda or cpu; on the CPU the kernels run under the interpreter, which must be
    switched on before any kernel module is imported."""
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def weight_bytes(model) -> tuple[int, int]:
    """(every parameter of this rank, the parameters a decode step reads: an untied embedding table is
    only gathered from, B rows per step)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    read = total if model.cfg.tie_word_embeddings else total - emb.numel() * emb.element_size()
    return total, read


def _drain(eng) -> None:
    for rid in list(eng.scheduler.by_id):
        eng.abort_request(rid)
    while eng.core._pending is not None or eng.has_unfinished():
        eng.step()


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def graph_replay_ms(runner, bs: int, calls: int = 20) -> float | None:
    """The captured decode graph of batch `bs` replayed back to back (its inputs as the last step left
    them): the model's GPU time per step without any host work. TP=1 only (a replay at TP>1 needs the
    workers to replay with it)."""
    import torch
    if runner.world_size != 1 or bs not in runner.graphs:
        return None
    g, _ = runner.graphs[bs]
    g.replay()
    torch.cuda.synchronize(runner.device)
    return time_per_call_ms(g.replay, calls=calls, samples=5)


def measure_batch(eng, batch: int, async_mode: bool, args, bytes_per_token: int, seed: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tp_overlap_plugin.serving import SamplingParams

    dev = eng.device
    eng.cfg.async_scheduling = async_mode          # rank 0 decides; the step message tells the workers
    after_prefill = args.warmup + args.steps + args.profile_steps
    prompt_len = max(1, args.context - after_prefill // 2)
    g = torch.Generator().manual_seed(seed)
    vocab = eng.mcfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=after_prefill + 8, ignore_eos=True)
    seqs = []
    for _ in range(batch):
        ids = torch.randint(min(10, vocab - 1), vocab, (prompt_len,), generator=g).tolist()
        seqs.append(eng.scheduler.by_id[eng.add_request(None, ids, params)])
    t0 = time.perf_counter()
    while any(s.num_computed < len(s.prompt_ids) for s in seqs) or eng.scheduler.waiting:
        eng.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        eng.step()
    _sync(dev)

    ctx_before = sum(s.num_tokens for s in seqs)
    stamps = [time.perf_counter()]
    for _ in range(args.steps):
        eng.step()
        stamps.append(time.perf_counter())
    ctx_after = sum(s.num_tokens for s in seqs)
    step_ms = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    mean_ctx = (ctx_before + ctx_after) / 2 / batch

    graph_ms = graph_replay_ms(eng.runner, batch) if dev.type == "cuda" else None

    activities = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with tempfile.TemporaryDirectory() as tmp:
        _sync(dev)
        with profile(activities=activities) as prof:
            t1 = time.perf_counter()
            for _ in range(args.profile_steps):
                eng.step()
            _sync(dev)
            profiled_wall = (time.perf_counter() - t1) * 1e3 / args.profile_steps
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = device_events(path)
    breakdown = kernel_breakdown(events, args.profile_steps)
    decoding = sum(1 for s in seqs if s.status.value == "running")
    _drain(eng)

    med = statistics.median(step_ms)
    kv_bytes = mean_ctx * batch * bytes_per_token
    res = {
        "batch": batch, "async_scheduling": async_mode, "prompt_len": prompt_len, "mean_context": mean_ctx,
        "sequences_decoding": decoding, "prefill_s": prefill_s,
        "step_ms_median": med, "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_min": min(step_ms), "step_ms_max": max(step_ms),
        "output_tokens_per_s": batch / (med / 1e3),
        "graph_replay_ms": graph_ms, "profiled_step_wall_ms": profiled_wall,
        "kv_bytes_per_step": kv_bytes, **breakdown,
    }
    busy = breakdown["gpu_busy_ms_per_step"]
    res["host_exposed_ms"] = med - busy if events else None
    return res


def add_floors(res: dict, weights: tuple[int, int], bw: float | None) -> None:
    if not bw:
        res.update(floor_ms=None, floor_read_ms=None, x_floor=None)
        return
    res["floor_ms"] = (weights[0] + res["kv_bytes_per_step"]) / bw * 1e3
    res["floor_read_ms"] = (weights[1] + res["kv_bytes_per_step"]) / bw * 1e3
    res["x_floor"] = res["step_ms_median"] / res["floor_ms"]
    if res.get("graph_replay_ms"):
        res["graph_x_floor"] = res["graph_replay_ms"] / res["floor_ms"]


def run_engine(args, batches: list[int], modes: list[bool], payload: dict, save) -> None:
    import torch

    from tp_overlap_plugin.serving import LLM, EngineConfig

    bs = 16
    after_prefill = args.warmup + args.steps + args.profile_steps
    max_len = args.context + after_prefill + 32
    cfg = EngineConfig(
        model=args.model, tensor_parallel_size=args.tp, device=args.device, show_progress=False,
        load_format="dummy" if args.model != "demo" else "auto",
        max_num_seqs=max(batches), max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=max(batches) * (-(-max_len // bs) + 1) + 8, block_size=bs,
        cuda_graph_batch_sizes=batches, enable_prefix_caching=False,
        tp_overlap=overlap_config(args))
    payload["config"]["engine"] = json.loads(cfg.model_dump_json())
    t0 = time.monotonic()
    with LLM(cfg) as llm:
        eng = llm.engine
        runner = eng.runner
        payload["load_s"] = time.monotonic() - t0
        log("decode", f"engine ready in {payload['load_s']:.1f} s")
        weights = weight_bytes(runner.model)
        bytes_per_token = runner.kv_bytes_per_block() // runner.block_size
        payload["weights_bytes_per_rank"], payload["weights_read_bytes_per_rank"] = weights
        payload["kv_bytes_per_token_per_rank"] = bytes_per_token
        bw = payload["environment"].get("hbm_copy_bytes_per_s")
        for i, batch in enumerate(batches):
            for async_mode in modes:
                t = time.monotonic()
                res = measure_batch(eng, batch, async_mode, args, bytes_per_token, seed=1000 * i + async_mode)
                add_floors(res, weights, bw)
                payload["results"].append(res)
                log("decode", f"batch {batch} {'async' if async_mode else 'sync '}: {res['step_ms_median']:.3f} ms/step"
                    + (f" ({res['x_floor']:.2f}x floor {res['floor_ms']:.3f})" if res["x_floor"] else "")
                    + f", GPU busy {res['gpu_busy_ms_per_step']:.3f} ms, ctx {res['mean_context']:.0f}; "
                    f"{time.monotonic() - t:.1f} s")
                save()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ---- the attention kernel alone -----------------------------------------------------------------

def _decode_v1():
    """The decode kernel before issue 16 (one program per (sequence, query head), whole context): the
    baseline the attention table compares against."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, Out, context_lens, block_tables, stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
               stride_ot, stride_oh, stride_bt, scale, GROUP: tl.constexpr, PAGE: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        ctx = tl.load(context_lens + s)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(Q + s * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start_n in range(0, ctx, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < ctx
            blk = tl.load(block_tables + s * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
            kv_off = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
            k = tl.load(K + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                        other=0.0).to(tl.float32)
            qk = tl.sum(k * q[None, :], 1) * scale
            qk = tl.where(n_mask, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))
            p = tl.exp(qk - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(V + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                        other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        tl.store(Out + s * stride_ot + h * stride_oh + offs_d, (acc / l_i).to(Out.dtype.element_ty), mask=d_mask)

    def run(q, k_cache, v_cache, ctx, bt, scale, out):
        import triton as _t
        s, h, d = q.shape
        kernel[(s, h)](q, k_cache, v_cache, out, ctx, bt, q.stride(0), q.stride(1), k_cache.stride(0),
                       k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), bt.stride(0), scale,
                       GROUP=h // k_cache.shape[2], PAGE=k_cache.shape[1], HEAD_DIM=d, BLOCK_N=64,
                       BLOCK_D=_t.next_power_of_2(d))
        return out
    return run


def _time_ms(fn, dev, calls: int = 20, samples: int = 7) -> float:
    if dev.type != "cuda":   # the interpreter: a logic check, one call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return time_per_call_ms(fn, calls=calls, samples=samples)


def attention_bench(args, mcfg, batches: list[int], bw: float | None) -> list[dict]:
    """The decode kernel alone at each batch, this rank's heads, --context tokens per sequence."""
    import torch

    from tp_overlap_plugin.kernels.attention import decode_num_splits, paged_decode_attention

    dev = torch.device(args.device)
    heads, kvh, d, page = mcfg.num_heads // args.tp, mcfg.num_kv_heads // args.tp, mcfg.head_dim, 16
    dtype = torch.bfloat16
    v1 = _decode_v1()
    rows = []
    for batch in batches:
        ctx = args.context
        nb = -(-ctx // page)
        blocks = batch * nb + 1
        k_cache = torch.randn(blocks, page, kvh, d, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        bt = torch.randperm(blocks - 1, device=dev)[:batch * nb].view(batch, nb).to(torch.int32).contiguous()
        ctxs = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, d, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        kv = 2 * batch * ctx * kvh * d * 2
        scale = d ** -0.5
        ref = paged_decode_attention(q, k_cache, v_cache, ctxs, bt, scale, num_splits=1).float()
        variants = [("v1: program per (seq, q head)", lambda: v1(q, k_cache, v_cache, ctxs, bt, scale, out), {})]
        auto = decode_num_splits(batch, kvh, dev)
        variants.append((f"v2 (shipped): group per program, {auto} split(s)",
                         lambda: paged_decode_attention(q, k_cache, v_cache, ctxs, bt, scale, out=out), {}))
        if args.attention_sweep:
            for splits in sorted({1, 2, 4, 8, 16} - {auto}):
                variants.append((f"v2 splits={splits}", None, dict(num_splits=splits)))
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        variants.append((f"v2 BLOCK_N={bn} warps={warps} stages={stages}", None,
                                         dict(block_n=bn, num_warps=warps, num_stages=stages)))
        for name, fn, kw in variants:
            if fn is None:
                def fn(kw=kw):
                    return paged_decode_attention(q, k_cache, v_cache, ctxs, bt, scale, out=out, **kw)
            try:
                fn()
                err = (out.float() - ref).abs().max().item()
                ms = _time_ms(fn, dev)
                rows.append({"batch": batch, "context": ctx, "heads": heads, "kv_heads": kvh, "variant": name,
                             "us": ms * 1e3, "kv_bytes": kv, "gb_per_s": kv / (ms / 1e3) / 1e9,
                             "x_hbm_floor": (ms / 1e3) / (kv / bw) if bw else None, "max_abs_err": err})
            except Exception as e:   # a variant that does not compile (shared memory) is reported, not fatal
                rows.append({"batch": batch, "context": ctx, "variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
            log("attention", f"batch {batch}: {name}: " + (f"{rows[-1]['us']:.1f} us, {rows[-1]['gb_per_s']:.0f} GB/s"
                                                            if "us" in rows[-1] else rows[-1]["error"]))
        del k_cache, v_cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- output -------------------------------------------------------------------------------------

def markdown(payload: dict) -> str:
    env = payload["environment"]
    bw = env.get("hbm_copy_bytes_per_s")
    lines = [f"# Decode step profile: {payload['config']['model']}, TP={payload['config']['tp']}\n",
             f"Command: `{payload['command']}`\n"]
    if bw:
        lines.append(f"HBM copy bandwidth (read + write, measured in this run): {bw / 1e12:.2f} TB/s. Weights per "
                     f"rank: {payload.get('weights_bytes_per_rank', 0) / 1e9:.2f} GB (read per step: "
                     f"{payload.get('weights_read_bytes_per_rank', 0) / 1e9:.2f} GB); KV "
                     f"{payload.get('kv_bytes_per_token_per_rank', 0) / 1024:.0f} KiB per token per rank.\n")
    if payload["results"]:
        rows = []
        for r in payload["results"]:
            ms = r["ms_per_step"]
            rows.append([r["batch"], "async" if r["async_scheduling"] else "sync", round(r["mean_context"]),
                         r["step_ms_median"], r["floor_ms"] if r["floor_ms"] else "-",
                         f"{r['x_floor']:.2f}x" if r["x_floor"] else "-",
                         r["graph_replay_ms"] if r["graph_replay_ms"] else "-", r["gpu_busy_ms_per_step"],
                         r["host_exposed_ms"] if r["host_exposed_ms"] is not None else "-",
                         *[ms[c] for c in CATEGORIES], round(r["kernels_per_step"]), round(r["output_tokens_per_s"])])
        lines.append("Per step, ms (median step; kernels: profiler sum per category, per step):\n")
        lines.append(md_table(["batch", "sched", "ctx", "step", "floor", "x floor", "graph replay", "GPU busy",
                               "host exposed", *CATEGORIES, "kernels", "out tok/s"], rows))
        lines.append("floor = (weights + live KV of this rank) / HBM copy bandwidth; graph replay = the captured "
                     "decode graph alone, back to back (TP=1); host exposed = step - GPU busy.\n")
        for r in (r for r in payload["results"] if r["top_kernels"]):
            lines.append(f"\nTop kernels, batch {r['batch']} {'async' if r['async_scheduling'] else 'sync'}:\n")
            lines.append(md_table(["kernel", "category", "ms/step", "calls/step"],
                                  [[k["name"][:90], k["category"], k["ms_per_step"], k["calls_per_step"]]
                                   for k in r["top_kernels"][:8]]))
    if payload.get("attention"):
        rows = [[a["batch"], a["context"], a["variant"], a.get("us", "-"), a.get("gb_per_s", "-"),
                 f"{a['x_hbm_floor']:.2f}x" if a.get("x_hbm_floor") else "-",
                 a.get("max_abs_err", a.get("error", "-"))] for a in payload["attention"]]
        lines.append("\nPaged decode attention alone (one layer, this rank's heads, bf16):\n")
        lines.append(md_table(["batch", "context", "variant", "us", "GB/s", "x floor", "max err / error"], rows))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=384,
                   help="tokens per sequence around the measured steps (batch-256 scenario mean: 128 in + 256)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch and mode")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--sched", default="both", choices=["sync", "async", "both"])
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--attention-only", action="store_true", help="skip the engine: the kernel table alone")
    p.add_argument("--no-attention", action="store_true", help="skip the kernel table")
    p.add_argument("--attention-sweep", action="store_true", help="kernel variants (tiles, warps, stages, splits)")
    add_engine_args(p)
    args = p.parse_args(argv)
    resolve_device(args)
    on_gpu = args.device == "cuda"
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    modes = {"sync": [False], "async": [True], "both": [False, True]}[args.sched]

    from tp_overlap_plugin.serving import EngineConfig
    mcfg = EngineConfig(model=args.model).load_model_config()
    env = environment(args.tp, on_gpu)
    if on_gpu:
        env["hbm_copy_bytes_per_s"] = hbm_copy_bandwidth()
        log("decode", f"HBM copy bandwidth {env['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")
    payload = {"schema": SCHEMA, "environment": env, "command": " ".join(["python", "bench/decode_profile.py"]
                                                                          + list(argv if argv is not None else sys.argv[1:])),
               "config": {"model": args.model, "tp": args.tp, "batches": batches, "context": args.context,
                          "steps": args.steps, "profile_steps": args.profile_steps, "warmup": args.warmup,
                          "sched": args.sched, "tp_overlap": args.tp_overlap},
               "results": [], "attention": []}
    name = f"decode-profile-{args.model}-tp{args.tp}" + (f"-{args.tag}" if args.tag else "")

    def save():
        paths = write_results(args.out, name, payload, markdown(payload))
        return paths

    if (on_gpu or args.attention_only) and not args.no_attention:
        payload["attention"] = attention_bench(args, mcfg, batches, env.get("hbm_copy_bytes_per_s"))
        save()
    if not args.attention_only:
        run_engine(args, batches, modes, payload, save)
    paths = save()
    print(markdown(payload))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
