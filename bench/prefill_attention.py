"""Prefill attention against the bf16 peak measured in the same run (issue 29, item 4): our Triton
kernel (paged, reads keys from the cache) beside torch's SDPA on the step's own keys and values (a
fresh prompt's context is the chunk itself; its own backend choice, then cuDNN and FA2 forced), FA2's
varlen call over the packed prompts, and flex_attention with a packed-causal block mask.

    python bench/prefill_attention.py --model llama-3-8b --tp 1 [--shapes 1x8192,4x2048,16x512,mix8192]
        [--configs "128,32,4,3,4;128,64,8,3,1"]   # more rows of our kernel: bm,bn,warps,stages,heads
        [--min-lens 1,256,1024,0]                 # more rows of the engine's dispatch, by SDPA_MIN_LEN
        [--ours-only]                             # our kernel alone, e.g. under an older install

Shapes: BxL (B prompts of L tokens), or mixN: lognormal lengths (median 256, sigma 1, seeded, at
most 2048) drawn until they hold N tokens, the last one cut to fit. "engine dispatch" is the call
the engine makes (serving.model.attention.paged_attention: SDPA for fresh prompts of at least
SDPA_MIN_LEN tokens, our kernel for the rest), its host time per call beside it (the launches,
measured without waiting for the GPU: eager attention runs between piecewise graph segments).

Work: causal attention, 4 x heads x head_dim x L(L+1)/2 per prompt (QK^T and PV). Peak: torch.matmul
bf16 [T, hidden] x [hidden, 2 x intermediate] at the step's token count, timed in the same run.
JSON + markdown in bench/results/ (prefill-attention-<model>-tp<N>-<device>-<date>).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, log, md_table, publish, time_per_call_ms  # noqa: E402


def prompt_lengths(shape: str) -> list[int]:
    """BxL -> [L] * B; mixN -> seeded lognormal lengths (median 256, sigma 1, 1-2048) holding N tokens."""
    if shape.startswith("mix"):
        total, rng, lens = int(shape[3:]), random.Random(29), []
        while sum(lens) < total:
            lens.append(max(1, min(2048, round(rng.lognormvariate(0, 1) * 256))))
        lens[-1] -= sum(lens) - total
        return [n for n in lens if n > 0]
    b, L = map(int, shape.split("x"))
    return [L] * b


def host_us(fn, calls: int = 10) -> float:
    """Host time per call, launches only: the GPU has not caught up when the clock stops."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / calls


def sdpa_kernel_names(fn) -> str:
    """The GPU kernels torch's SDPA launched for `fn` (its backend choice), from one profiled call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the name is informative only
        return f"? ({type(e).__name__})"
    names = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA" and "emcpy" not in e.key})
    return "; ".join(n[:60] for n in names)[:200] or "?"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--shapes", default="1x8192,4x2048,16x512,mix8192", help="prompts x length per step, or mixN")
    p.add_argument("--min-lens", default="1,256,1024,0",
                   help="extra rows of the engine's dispatch at these SDPA_MIN_LEN (0: our kernel alone)")
    p.add_argument("--configs", default="",
                   help="extra rows for our kernel, ';'-separated block_m,block_n,num_warps,num_stages,heads_per_tile")
    p.add_argument("--ours-only", action="store_true", help="time our kernel alone (e.g. under an older install)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    from tp_overlap_plugin.kernels.attention import paged_prefill_attention
    from tp_overlap_plugin.serving.model import attention as engine_attn
    from tp_overlap_plugin.serving.model.attention import AttnMeta
    default_min_len = engine_attn.SDPA_MIN_LEN
    from tp_overlap_plugin.serving.config import EngineConfig
    mcfg = EngineConfig(model=args.model, load_format="dummy").load_model_config()
    h, hkv, d = mcfg.num_heads // args.tp, mcfg.num_kv_heads // args.tp, mcfg.head_dim
    dev, dt, page = "cuda", torch.bfloat16, 16
    scale = d ** -0.5
    rows, results, sdpa_kernels = [], [], {}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - an old torch: the table says so
        flex, flex_err = None, str(e)
    for shape in args.shapes.split(","):
        lens = prompt_lengths(shape)
        b, L, T = len(lens), max(lens), sum(lens)
        equal = len(set(lens)) == 1
        a = torch.randn(T, mcfg.hidden_size, device=dev, dtype=dt)
        w = torch.randn(mcfg.hidden_size, 2 * mcfg.intermediate_size // args.tp, device=dev, dtype=dt)
        mm_ms = time_per_call_ms(lambda: a @ w, calls=10, samples=7)
        peak = 2 * T * w.shape[0] * w.shape[1] / (mm_ms / 1e3)
        flops = sum(4 * h * d * n * (n + 1) / 2 for n in lens)
        q = torch.randn(T, h, d, device=dev, dtype=dt)
        k = torch.randn(T, hkv, d, device=dev, dtype=dt)
        v = torch.randn(T, hkv, d, device=dev, dtype=dt)
        nbs = [-(-n // page) for n in lens]
        kc = torch.zeros(sum(nbs) + 1, page, hkv, d, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        bt = torch.zeros(b, max(nbs), device=dev, dtype=torch.int32)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        slots, blk = [], 0
        for i, (n, nb) in enumerate(zip(lens, nbs)):   # the same keys in the cache, block by block
            bt[i, :nb] = torch.arange(blk, blk + nb, device=dev, dtype=torch.int32)
            kc.view(-1, hkv, d)[blk * page:blk * page + n] = k[starts[i]:starts[i + 1]]
            vc.view(-1, hkv, d)[blk * page:blk * page + n] = v[starts[i]:starts[i + 1]]
            slots += range(blk * page, blk * page + n)
            blk += nb
        cu = torch.tensor(starts, device=dev, dtype=torch.int32)
        ctx = torch.tensor(lens, device=dev, dtype=torch.int32)
        meta = AttnMeta(slot_mapping=torch.tensor(slots, device=dev), num_decodes=0, cu_seqlens_q=cu,
                        context_lens=ctx, block_tables=bt, max_q_len=L, q_lens_list=lens, context_lens_list=lens,
                        use_triton=True)
        out = torch.empty_like(q)
        # name -> (the call timed, its output as [T, heads, head_dim])
        impls = {"triton (ours, paged)": (lambda: paged_prefill_attention(q, kc, vc, cu, ctx, bt, L, scale, out=out),
                                          lambda o: o)}
        for c in filter(None, args.configs.split(";")):
            bm_, bn_, w_, st_, hp_ = map(int, c.split(","))
            impls[f"triton (ours, paged) {bm_}x{bn_} w{w_} s{st_} heads{hp_}"] = (
                lambda bm_=bm_, bn_=bn_, w_=w_, st_=st_, hp_=hp_: paged_prefill_attention(
                    q, kc, vc, cu, ctx, bt, L, scale, out=out, block_m=bm_, block_n=bn_, num_warps=w_,
                    num_stages=st_, heads_per_tile=hp_), lambda o: o)
        if not args.ours_only:
            extra = [int(x) for x in filter(None, args.min_lens.split(",")) if int(x) != default_min_len]
            for ml in [default_min_len] + (extra if not equal else []):
                def dispatch(ml=ml):
                    engine_attn.SDPA_MIN_LEN = ml
                    try:
                        return engine_attn.paged_attention(q, kc, vc, meta, scale, out=out)
                    finally:
                        engine_attn.SDPA_MIN_LEN = default_min_len
                tag = ", the default" if ml == default_min_len else ""
                impls[f"engine dispatch (SDPA_MIN_LEN {ml}{tag})"] = (dispatch, lambda o: o)

        def sdpa_one(i):
            sl = slice(starts[i], starts[i + 1])
            return torch.nn.functional.scaled_dot_product_attention(
                *(x[sl].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True)
        if equal:
            qb, kb, vb = (x.view(b, L, -1, d).transpose(1, 2) for x in (q, k, v))

            def sdpa():
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                                        enable_gqa=True)
            as_thd = lambda o: o.transpose(1, 2).reshape(T, h, d)   # noqa: E731
        else:   # one call per prompt, its own keys (no gather, no copy into a packed output)
            def sdpa():
                return [sdpa_one(i) for i in range(b)]
            as_thd = lambda o: torch.cat([x[0].transpose(0, 1) for x in o])   # noqa: E731
        ref = as_thd(sdpa()).float()
        if not args.ours_only:
            impls["torch SDPA (dense per prompt, its own choice)" if equal else
                  "torch SDPA (one call per prompt, its own choice)"] = (sdpa, as_thd)
            sdpa_kernels[shape] = sdpa_kernel_names(sdpa)
            log("attn", f"{shape}: torch SDPA's kernels: {sdpa_kernels[shape]}")
        if not args.ours_only and not equal:
            # right-padded to the longest prompt, one call (gathers in, the real rows out included):
            # causal masking hides the padded keys (they follow every real query) from real rows
            pad_idx = torch.tensor([starts[i] + min(j, lens[i] - 1) for i in range(b) for j in range(L)], device=dev)
            real = torch.tensor([i * L + j for i in range(b) for j in range(lens[i])], device=dev)

            def padded():
                qp, kp, vp = (x.index_select(0, pad_idx).view(b, L, -1, d).transpose(1, 2) for x in (q, k, v))
                o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                                     enable_gqa=True)
                return o.transpose(1, 2).reshape(b * L, h, d).index_select(0, real)
            impls["torch SDPA (right-padded to the longest, one call)"] = (padded, lambda o: o)
        # which backend makes SDPA fast: the engine's flash-attention varlen call below is FA2
        for backend in () if args.ours_only or not equal else ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            def forced(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return sdpa()
            impls[f"torch SDPA ({backend.lower()})"] = (forced, as_thd)
        # packed sequences over their own keys, as the engine would call it: FA2 varlen, GQA native
        if not args.ours_only:
            impls["aten._flash_attention_forward (varlen)"] = (
                lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False,
                                                                scale=scale)[0], lambda o: o)
        if flex is not None and not args.ours_only:
            doc = torch.repeat_interleave(torch.arange(b, device=dev), ctx.long())

            def packed_causal(bi, hi, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)
            bm = create_block_mask(packed_causal, None, None, T, T, device=dev)
            q1, k1, v1 = (x.transpose(0, 1)[None] for x in (q, k, v))
            impls["flex_attention (packed varlen)"] = (
                lambda: flex(q1, k1, v1, block_mask=bm, scale=scale, enable_gqa=True), lambda o: o[0].transpose(0, 1))
        for name, (fn, as_out) in impls.items():
            try:
                out.fill_(float("nan"))   # rows a dispatch leaves unwritten stay NaN
                err = (as_out(fn()).float() - ref).abs().max().item()
                ms = time_per_call_ms(fn, calls=10, samples=7)
                res = {"shape": shape, "impl": name, "ms": ms, "tflops": flops / ms / 1e9,
                       "of_peak": flops / (ms / 1e3) / peak, "max_abs_err_vs_sdpa": err, "peak_tflops": peak / 1e12,
                       "host_us": host_us(fn), "prompts": b, "tokens": T}
            except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
                res = {"shape": shape, "impl": name, "error": f"{type(e).__name__}: {e}"[:300]}
            results.append(res)
            log("attn", str(res))
            rows.append([shape, name, res.get("ms", "-"), res.get("tflops", "-"), res.get("of_peak", "-"),
                         res.get("host_us", "-"), res.get("peak_tflops", "-"),
                         res.get("max_abs_err_vs_sdpa", res.get("error", "-"))])
    payload = {"schema": "prefill-attention/1", "environment": environment(args.tp, True, model=args.model),
               "config": vars(args), "results": results, "sdpa_kernels": sdpa_kernels}
    md = (f"# Prefill attention vs the bf16 peak: {args.model}, TP={args.tp} ({h} heads, {hkv} kv heads, d={d})\n\n"
          + f"Shapes: {', '.join(f'{sh}: {len(prompt_lengths(sh))} prompts' for sh in args.shapes.split(','))}; "
          + "".join(f"{sh} lengths (step order): {prompt_lengths(sh)}. " for sh in args.shapes.split(",") if sh.startswith("mix"))
          + "\n\n"
          + md_table(["prompts x len", "implementation", "ms", "TFLOP/s", "of matmul peak", "host us/call",
                      "peak TFLOP/s", "max |err| vs SDPA"], rows))
    md += "".join(f"\n\n{sh}: torch SDPA's kernels (its own choice): {names}" for sh, names in sdpa_kernels.items())
    if flex is None and not args.ours_only:
        md += f"\n\nflex_attention unavailable: {flex_err}\n"
    publish(args.out, f"prefill-attention-{args.model}-tp{args.tp}", payload, md)


if __name__ == "__main__":
    main()
