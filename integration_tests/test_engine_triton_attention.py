"""Triton paged attention kernels (and the engine's in-graph step-input fix-up) vs torch references,
under TRITON_INTERPRET=1 on CPU.

The interpreter is chosen when a kernel is defined, so the checks run in a fresh interpreter process
(this file executed as a script) rather than in the pytest process.
"""

import os

import pytest


def _case(seed, q_lens, ctx_lens, heads, kv_heads, head_dim, page, dtype, dev="cpu", decode_splits=(None,),
          prefill_kws=({},)):
    import torch

    from tp_overlap_plugin.kernels.attention import paged_decode_attention, paged_prefill_attention
    from tp_overlap_plugin.serving.model.attention import AttnMeta, paged_attention_ref

    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-c // page) for c in ctx_lens) + 3
    k_cache = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()   # scattered, non-monotonic block ids
    tables = []
    for c in ctx_lens:
        nb = -(-c // page)
        tables.append(perm[:nb])
        perm = perm[nb:]
    width = max(len(t) for t in tables)
    bt = torch.full((len(tables), width), n_blocks - 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    if dev != "cpu":
        k_cache, v_cache, bt, q, cu, ctx = (x.to(dev) for x in (k_cache, v_cache, bt, q, cu, ctx))
    meta = AttnMeta(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=nd, cu_seqlens_q=cu,
                    context_lens=ctx, block_tables=bt, max_q_len=max(q_lens), q_lens_list=list(q_lens),
                    context_lens_list=list(ctx_lens))
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kw in prefill_kws:
        got = paged_prefill_attention(q, k_cache, v_cache, cu, ctx, bt, max(q_lens), scale, **kw).float()
        err = (got - ref).abs().max().item()
        assert err < tol, f"prefill max error {err} (q_lens={q_lens}, ctx={ctx_lens}, {dtype}, {kw})"
    if nd:
        for splits in decode_splits:
            got = paged_decode_attention(q[:nd], k_cache, v_cache, ctx[:nd], bt[:nd], scale,
                                         num_splits=splits).float()
            err = (got - ref[:nd]).abs().max().item()
            assert err < tol, f"decode max error {err} (ctx={ctx_lens[:nd]}, {dtype}, {splits} splits)"


def _ref64(q, kc, vc, bt, q_lens, ctx_lens, scale):
    """Causal attention of every sequence over the first ctx_lens[s] slots of its blocks, in float64."""
    import torch

    heads, page, kv_heads, head_dim = q.shape[1], kc.shape[1], kc.shape[2], kc.shape[3]
    grp, dev = heads // kv_heads, q.device
    ref = torch.empty(q.shape, dtype=torch.float64, device=dev)
    start = 0
    for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        rows = bt[i, :-(-cl // page)].long()
        k = kc[rows].reshape(-1, kv_heads, head_dim)[:cl].double()
        v = vc[rows].reshape(-1, kv_heads, head_dim)[:cl].double()
        qs = q[start:start + ql].double()
        visible = torch.arange(cl, device=dev)[None, :] <= torch.arange(cl - ql, cl, device=dev)[:, None]
        for kh in range(kv_heads):
            sc = torch.einsum("qgd,kd->gqk", qs[:, kh * grp:(kh + 1) * grp], k[:, kh]) * scale
            p = torch.softmax(sc.masked_fill(~visible, float("-inf")), -1)
            ref[start:start + ql, kh * grp:(kh + 1) * grp] = torch.einsum("gqk,kd->qgd", p, v[:, kh])
        start += ql
    return ref


def _dispatch_case(seed, q_lens, ctx_lens, heads, kv_heads, head_dim, page, dtype, min_lens, dev="cpu"):
    """serving.model.attention.paged_attention's GPU path (decode kernel, prefill kernel, SDPA for fresh
    prompts of at least min_len tokens) into a NaN-poisoned output, against float64. The step's keys
    sit in the cache at the slots slot_mapping names (the SDPA path gathers them from there)."""
    import torch

    from tp_overlap_plugin.serving.model import attention as attn

    g = torch.Generator().manual_seed(seed)
    nbs = [-(-c // page) for c in ctx_lens]
    n_blocks = sum(nbs) + 2
    kc = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()   # scattered, non-monotonic block ids
    bt = torch.full((len(ctx_lens), max(nbs)), n_blocks - 1, dtype=torch.int32)
    slots = []
    for i, (nb, ql, cl) in enumerate(zip(nbs, q_lens, ctx_lens)):
        bt[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        slots += [int(bt[i, j // page]) * page + j % page for j in range(cl - ql, cl)]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1 and ctx_lens[nd] > 1:
        nd += 1
    k_cache, v_cache, bt, q, cu = (x.to(dev) for x in (kc, vc, bt, q, cu))
    meta = attn.AttnMeta(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), num_decodes=nd,
                         cu_seqlens_q=cu, context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                         block_tables=bt, max_q_len=max(q_lens), q_lens_list=list(q_lens),
                         context_lens_list=list(ctx_lens), use_triton=True)
    scale = head_dim ** -0.5
    ref = _ref64(q, k_cache, v_cache, bt, q_lens, ctx_lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    default = attn.SDPA_MIN_LEN
    try:
        for min_len in min_lens:
            attn.SDPA_MIN_LEN = min_len
            out = torch.full_like(q, float("nan"))
            attn.paged_attention(q, k_cache, v_cache, meta, scale, out=out)
            err = (out.double() - ref).abs().max().item()
            sdpa = [r[1:] for r in meta.fresh_plan(min_len).runs] if dtype in attn.SDPA_DTYPES else []
            assert err < tol, f"dispatch max error {err} (q_lens={q_lens}, ctx={ctx_lens}, min_len {min_len}, " \
                              f"SDPA runs {sdpa}, {dtype})"
    finally:
        attn.SDPA_MIN_LEN = default
    return meta


def _f64_case(seed, q_lens, ctx_lens, heads, kv_heads, head_dim, page, dtype, prefill_kws=({},), dev="cuda"):
    """GPU-sized prefill against a float64 reference, into NaN-poisoned outputs (rows the kernel
    skips stay NaN and fail). Sequence s's keys are the first ctx_lens[s] slots of its blocks."""
    import torch

    from tp_overlap_plugin.kernels.attention import paged_prefill_attention

    g = torch.Generator(device=dev).manual_seed(seed)
    nbs = [-(-c // page) for c in ctx_lens]
    n_blocks = sum(nbs) + 1
    kc = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g, device=dev).to(dtype)
    vc = torch.randn(n_blocks, page, kv_heads, head_dim, generator=g, device=dev).to(dtype)
    perm = torch.randperm(n_blocks, generator=g, device=dev).to(torch.int32)
    bt = torch.zeros(len(ctx_lens), max(nbs), dtype=torch.int32, device=dev)
    at = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[at:at + nb]
        at += nb
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g, device=dev).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    scale = head_dim ** -0.5
    ref = _ref64(q, kc, vc, bt, q_lens, ctx_lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for kw in prefill_kws:
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, kc, vc, cu, ctx, bt, max(q_lens), scale, out=out, **kw)
        err = (out.double() - ref).abs().max().item()
        assert err < tol, f"prefill max error {err} vs float64 (q_lens {q_lens[:4]}.., ctx {ctx_lens[:4]}.., {kw})"


def gpu_prefill_checks(prefill_kws=({},)):
    """The benchmark's shapes (llama-3-8b heads) and chunked / mixed / odd cases, against float64."""
    import torch

    bf = torch.bfloat16
    for seed, (b, L) in enumerate([(1, 8192), (4, 2048), (16, 512)]):
        _f64_case(20 + seed, [L] * b, [L] * b, 32, 8, 128, 16, bf, prefill_kws)
    # chunks continuing cached prefixes, one-token rows among them, lengths no tile divides
    _f64_case(30, [1000, 300, 1, 77, 1, 513], [3000, 300, 1500, 77, 1, 2049], 32, 8, 128, 16, bf, prefill_kws)
    _f64_case(31, [129, 1, 700], [4097, 9, 1400], 32, 4, 128, 32, bf, prefill_kws)       # GQA 8, page 32
    _f64_case(32, [257, 64, 1], [257, 1000, 63], 8, 8, 64, 7, bf, prefill_kws)           # GQA 1, d 64, page 7
    _f64_case(33, [300, 1, 45], [900, 50, 45], 32, 8, 128, 16, torch.float32)            # float32 tiles
    _f64_case(34, [200, 1], [500, 33], 16, 2, 64, 16, torch.float32)


def main(dev="cpu"):
    import torch

    # decodes first then prefill chunks with earlier context (chunked prefill), GQA, odd page size.
    _case(0, [1, 1, 1, 5, 19], [1, 7, 33, 5, 40], heads=4, kv_heads=2, head_dim=16, page=4,
          dtype=torch.float32, dev=dev)
    _case(1, [1, 1, 37], [70, 3, 37], heads=6, kv_heads=2, head_dim=24, page=16, dtype=torch.float32, dev=dev)
    _case(2, [1, 17], [20, 50], heads=2, kv_heads=1, head_dim=32, page=8, dtype=torch.bfloat16, dev=dev)
    # Prefill tiles: a GQA group of 4 packed into one program (heads_per_tile), key tiles wider and
    # narrower than the query tile, so chunks continuing a cached prefix cross several unmasked
    # tiles before the diagonal ones; one-token rows and lengths that are no multiple of anything.
    tiles = ({}, {"heads_per_tile": 4, "block_m": 32}, {"heads_per_tile": 2, "block_m": 16, "block_n": 32},
             {"block_m": 32, "block_n": 16})
    _case(9, [1, 45, 3, 20], [9, 45, 70, 83], heads=8, kv_heads=2, head_dim=32, page=5, dtype=torch.float32,
          dev=dev, prefill_kws=tiles)
    _case(10, [33, 1], [100, 64], heads=8, kv_heads=2, head_dim=16, page=16, dtype=torch.bfloat16, dev=dev,
          prefill_kws=tiles)
    # Decode alone, flash-decoding: GQA ratios 1, 4 and 8, contexts of 1 and of lengths that are no
    # multiple of the page or the key tile (16 on the CPU), one split, a few (some empty for the
    # short contexts) and the automatic choice.
    splits = (1, 3, 16, None)
    _case(4, [1] * 5, [1, 17, 40, 5, 63], heads=4, kv_heads=4, head_dim=16, page=4, dtype=torch.float32,
          dev=dev, decode_splits=splits)
    _case(5, [1] * 4, [33, 1, 90, 16], heads=8, kv_heads=2, head_dim=32, page=8, dtype=torch.float32,
          dev=dev, decode_splits=splits)
    _case(6, [1] * 3, [50, 2, 129], heads=16, kv_heads=2, head_dim=16, page=16, dtype=torch.bfloat16,
          dev=dev, decode_splits=splits)
    if dev != "cpu":   # GPU-sized tiles: several key tiles, long decode contexts, head_dim 128
        gpu_prefill_checks()
        _case(3, [1] * 8 + [300, 129], [1, 64, 65, 500, 1000, 7, 2048, 3000, 300, 700], heads=32, kv_heads=8,
              head_dim=128, page=16, dtype=torch.bfloat16, dev=dev, decode_splits=(1, 2, 7, 16, None))
        _case(7, [1] * 6, [1, 127, 129, 640, 4097, 33], heads=32, kv_heads=4, head_dim=128, page=16,
              dtype=torch.bfloat16, dev=dev, decode_splits=(1, 5, 16, None))
        _case(8, [1] * 3, [1000, 3, 70], heads=8, kv_heads=8, head_dim=64, page=16, dtype=torch.float32,
              dev=dev, decode_splits=(1, 4, None))
    # The engine's dispatch: fresh prompts (context = chunk) through SDPA, in runs of adjacent equal
    # lengths, the rest through the kernels that skip them on the device by the same rule.
    # Decodes, equal fresh lengths, then a fresh one-token prompt, a chunk continuing a prefix, a
    # prefix-cache hit, fresh lengths that are no multiple of anything; GQA 4 and 1.
    mix_q, mix_ctx = [1, 1, 20, 20, 20, 1, 5, 17, 9, 33, 33], [9, 30, 20, 20, 20, 1, 40, 17, 25, 33, 33]
    meta = _dispatch_case(11, mix_q, mix_ctx, heads=8, kv_heads=2, head_dim=32, page=5, dtype=torch.bfloat16,
                          min_lens=(1, 18, 0), dev=dev)
    # the plan the thresholds made: row, prompts, length of each SDPA call, and what the kernel keeps
    assert meta.fresh_plan(1).runs == [(2, 3, 20), (62, 1, 1), (68, 1, 17), (94, 2, 33)], meta.fresh_plan(1)
    assert meta.fresh_plan(1).kernel_max_q_len == 9 and meta.fresh_plan(18).kernel_max_q_len == 17
    assert meta.fresh_plan(18).runs == [(2, 3, 20), (94, 2, 33)] and not meta.fresh_plan(0).runs
    _dispatch_case(12, mix_q[2:], mix_ctx[2:], heads=4, kv_heads=4, head_dim=16, page=16, dtype=torch.bfloat16,
                   min_lens=(1,), dev=dev)
    # one fresh prompt alone; float32 keeps the kernel (no SDPA backend with GQA but the math one)
    _dispatch_case(13, [37], [37], heads=8, kv_heads=2, head_dim=32, page=16, dtype=torch.bfloat16,
                   min_lens=(1,), dev=dev)
    _dispatch_case(14, [1, 19], [7, 19], heads=8, kv_heads=2, head_dim=16, page=4, dtype=torch.float32,
                   min_lens=(1,), dev=dev)
    # The engine's in-graph step input fix-up (serving/worker/sampled_ids.py): ids -1-k become sampled[k].
    from tp_overlap_plugin.serving.worker.sampled_ids import _resolve_refs_kernel
    ids = torch.tensor([5, -1, 7, -3, 0, -2] * 300, dtype=torch.int64, device=dev)
    sampled = torch.tensor([11, 12, 13, 14], dtype=torch.int64, device=dev)
    want = torch.where(ids < 0, sampled[(-ids - 1).clamp(min=0)], ids)
    _resolve_refs_kernel[(2,)](ids, sampled, ids.numel(), BLOCK=1024)
    assert torch.equal(ids, want)
    print("triton attention ok")


@pytest.mark.timeout(180)
def test_triton_kernels_match_reference_under_interpreter():
    from serving_helpers import run_under_interpreter
    run_under_interpreter(__file__, "triton attention ok", timeout=170)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", ["sm90", "gfx942"])
@pytest.mark.parametrize("kernel", ["prefill", "decode", "decode_reduce"])
def test_attention_kernels_compile_for_gpu_targets(kernel, target):
    """The interpreter accepts code the GPU compilers reject; compile for Hopper and CDNA3 without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import torch

    from tp_overlap_plugin.kernels.attention import (_decode_kernel, _decode_reduce_kernel, _prefill_kernel,
                                                     prefill_config)

    tgt = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}[target]
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16"}
    strides = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_kb", "stride_kp", "stride_kh",
                                  "stride_ot", "stride_oh", "stride_bt")}
    if kernel == "prefill":
        fn = _prefill_kernel
        sig = {**ptrs, "cu_seqlens_q": "*i32", "context_lens": "*i32", "block_tables": "*i32", **strides,
               "scale": "fp32"}
        cfg = prefill_config({"sm90": "cuda", "gfx942": "hip"}[target], torch.bfloat16, 4)
        consts = {"GROUP": 4, "PAGE": 16, "HEAD_DIM": 128, "BLOCK_M": cfg["block_m"], "BLOCK_N": cfg["block_n"],
                  "BLOCK_D": 128, "HEADS": cfg["heads"], "PRECISION": "tf32", "UPCAST": False,
                  "FRESH_FROM": 2048}
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    elif kernel == "decode":
        fn = _decode_kernel
        sig = {**ptrs, "PartAcc": "*fp32", "PartML": "*fp32", "context_lens": "*i32", "block_tables": "*i32",
               **strides, "scale": "fp32"}
        consts = {"GROUP": 4, "PAGE": 16, "HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_G": 16, "BLOCK_N": 64,
                  "BLOCK_D": 128, "PRECISION": "tf32", "UPCAST": False}
    else:
        fn = _decode_reduce_kernel
        sig = {"PartAcc": "*fp32", "PartML": "*fp32", "Out": "*bf16", "stride_ot": "i32", "stride_oh": "i32"}
        consts = {"HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_S": 4, "BLOCK_D": 128}
    sig.update({c: "constexpr" for c in consts})
    # Launches specialise 16-divisible pointers and strides; without that the pipeliner keeps
    # unaligned loads synchronous and the shared-memory figure below would be the unpipelined one.
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "constexpr" and t != "fp32"}
    compiled = triton.compile(ASTSource(fn, signature=sig, constexprs=consts, attrs=aligned), target=tgt,
                              options=options if kernel == "prefill" else None)
    assert compiled.asm.get("cubin" if target == "sm90" else "hsaco")
    # The chosen tiles must fit the target's shared memory (CDNA3: one 64 KiB LDS per workgroup).
    assert compiled.metadata.shared <= {"sm90": 232448, "gfx942": 65536}[target], compiled.metadata.shared


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_triton_kernels_match_reference_on_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    main("cuda")


if __name__ == "__main__":
    main()
