"""Prefill attention against the bf16 peak measured in the same run (issue 29, item 4): our Triton
kernel (paged, reads keys from the cache) beside torch's SDPA on the step's own keys and values (a
fresh prompt's context is the chunk itself; its own backend choice, then cuDNN and FA2 forced), FA2's
varlen call over the packed prompts, and flex_attention with a packed-causal block mask.

    python bench/prefill_attention.py --model llama-3-8b --tp 1 [--shapes 1x8192,4x2048,16x512]
        [--configs "128,32,4,3,4;128,64,8,3,1"]   # more rows of our kernel: bm,bn,warps,stages,heads
        [--ours-only]                             # our kernel alone, e.g. under an older install

Work: causal attention, 4 x heads x head_dim x L(L+1)/2 per prompt (QK^T and PV). Peak: torch.matmul
bf16 [T, hidden] x [hidden, 2 x intermediate] at the step's token count, timed in the same run.
JSON + markdown in bench/results/ (prefill-attention-<model>-tp<N>-<device>-<date>).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, log, md_table, publish, time_per_call_ms  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--shapes", default="1x8192,4x2048,16x512", help="prompts x length per step")
    p.add_argument("--configs", default="",
                   help="extra rows for our kernel, ';'-separated block_m,block_n,num_warps,num_stages,heads_per_tile")
    p.add_argument("--ours-only", action="store_true", help="time our kernel alone (e.g. under an older install)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    from tp_overlap_plugin.kernels.attention import paged_prefill_attention
    from tp_overlap_plugin.serving.config import EngineConfig
    mcfg = EngineConfig(model=args.model, load_format="dummy").load_model_config()
    h, hkv, d = mcfg.num_heads // args.tp, mcfg.num_kv_heads // args.tp, mcfg.head_dim
    dev, dt, page = "cuda", torch.bfloat16, 16
    scale = d ** -0.5
    rows, results = [], []
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - an old torch: the table says so
        flex, flex_err = None, str(e)
    for shape in args.shapes.split(","):
        b, L = map(int, shape.split("x"))
        T = b * L
        a = torch.randn(T, mcfg.hidden_size, device=dev, dtype=dt)
        w = torch.randn(mcfg.hidden_size, 2 * mcfg.intermediate_size // args.tp, device=dev, dtype=dt)
        mm_ms = time_per_call_ms(lambda: a @ w, calls=10, samples=7)
        peak = 2 * T * w.shape[0] * w.shape[1] / (mm_ms / 1e3)
        flops = b * 4 * h * d * L * (L + 1) / 2
        q = torch.randn(T, h, d, device=dev, dtype=dt)
        k = torch.randn(T, hkv, d, device=dev, dtype=dt)
        v = torch.randn(T, hkv, d, device=dev, dtype=dt)
        nb = -(-L // page)
        kc = torch.zeros(b * nb + 1, page, hkv, d, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        bt = torch.arange(b * nb, device=dev, dtype=torch.int32).view(b, nb)
        for i in range(b):   # the same keys in the cache, block by block
            kc.view(-1, hkv, d)[i * nb * page:i * nb * page + L] = k[i * L:(i + 1) * L]
            vc.view(-1, hkv, d)[i * nb * page:i * nb * page + L] = v[i * L:(i + 1) * L]
        cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
        ctx = torch.full((b,), L, device=dev, dtype=torch.int32)
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
        qb, kb, vb = (x.view(b, L, -1, d).transpose(1, 2) for x in (q, k, v))

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                                    enable_gqa=True)
        as_thd = lambda o: o.transpose(1, 2).reshape(T, h, d)   # noqa: E731
        ref = sdpa().transpose(1, 2).reshape(T, h, d).float()
        if not args.ours_only:
            impls["torch SDPA (dense per prompt, its own choice)"] = (sdpa, as_thd)
        # which backend makes SDPA fast: the engine's flash-attention varlen call below is FA2
        for backend in () if args.ours_only else ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
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
            doc = torch.arange(T, device=dev) // L

            def packed_causal(bi, hi, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)
            bm = create_block_mask(packed_causal, None, None, T, T, device=dev)
            q1, k1, v1 = (x.transpose(0, 1)[None] for x in (q, k, v))
            impls["flex_attention (packed varlen)"] = (
                lambda: flex(q1, k1, v1, block_mask=bm, scale=scale, enable_gqa=True), lambda o: o[0].transpose(0, 1))
        for name, (fn, as_out) in impls.items():
            try:
                err = (as_out(fn()).float() - ref).abs().max().item()
                ms = time_per_call_ms(fn, calls=10, samples=7)
                res = {"shape": shape, "impl": name, "ms": ms, "tflops": flops / ms / 1e9,
                       "of_peak": flops / (ms / 1e3) / peak, "max_abs_err_vs_sdpa": err, "peak_tflops": peak / 1e12}
            except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
                res = {"shape": shape, "impl": name, "error": f"{type(e).__name__}: {e}"[:300]}
            results.append(res)
            log("attn", str(res))
            rows.append([shape, name, res.get("ms", "-"), res.get("tflops", "-"), res.get("of_peak", "-"),
                         res.get("peak_tflops", "-"), res.get("max_abs_err_vs_sdpa", res.get("error", "-"))])
    payload = {"schema": "prefill-attention/1", "environment": environment(args.tp, True, model=args.model),
               "config": vars(args), "results": results}
    md = (f"# Prefill attention vs the bf16 peak: {args.model}, TP={args.tp} ({h} heads, {hkv} kv heads, d={d})\n\n"
          + md_table(["prompts x len", "implementation", "ms", "TFLOP/s", "of matmul peak", "peak TFLOP/s",
                      "max |err| vs SDPA"], rows))
    if flex is None and not args.ours_only:
        md += f"\n\nflex_attention unavailable: {flex_err}\n"
    publish(args.out, f"prefill-attention-{args.model}-tp{args.tp}", payload, md)


if __name__ == "__main__":
    main()
