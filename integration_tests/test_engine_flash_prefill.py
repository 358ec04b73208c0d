"""Fresh prompt chunks through torch's flash attention (serving/attention.py): the same result as the
reference over the paged cache, in a pure prefill step and beside decodes, on GPUs only."""

import pytest
import torch

from tp_overlap_plugin.serving.attention import AttnMeta, flash_prefill_ok, paged_attention, paged_attention_ref


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,ctx", [([7, 300, 1, 64], [7, 300, 1, 64]),          # prefill only
                                        ([1, 1, 1, 33, 200], [40, 9, 130, 33, 200])])  # decodes + fresh
def test_flash_prefill_matches_reference(q_lens, ctx):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev, dt, page, heads, kv_heads, d = torch.device("cuda"), torch.bfloat16, 16, 8, 2, 128
    if torch.version.cuda:   # on CUDA the path must be taken, not silently skipped
        assert flash_prefill_ok(dev, dt, heads, kv_heads, d)
    g = torch.Generator(device=dev).manual_seed(1)
    t, s = sum(q_lens), len(q_lens)
    nd = next((i for i, q in enumerate(q_lens) if q > 1), s)
    widths = [-(-c // page) for c in ctx]
    bt = torch.full((s, max(widths)), sum(widths), dtype=torch.int32)
    ids = torch.randperm(sum(widths), device=dev, generator=g).to(torch.int32)
    at = 0
    for i, w in enumerate(widths):
        bt[i, :w] = ids[at:at + w].cpu()
        at += w
    bt = bt.to(dev)
    k_cache = torch.randn(sum(widths) + 1, page, kv_heads, d, device=dev, dtype=dt, generator=g)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(t, heads, d, device=dev, dtype=dt, generator=g)
    # this step's keys and values, as the model hands them over: already written into the cache
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx)]).to(dev)
    seq = torch.repeat_interleave(torch.arange(s, device=dev), torch.tensor(q_lens, device=dev))
    slots = bt[seq, pos // page].long() * page + pos % page
    k = k_cache.view(-1, kv_heads, d)[slots]
    v = v_cache.view(-1, kv_heads, d)[slots]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    meta = AttnMeta(slot_mapping=slots, num_decodes=nd, cu_seqlens_q=cu,
                    context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), block_tables=bt,
                    max_q_len=max(q_lens), q_lens_list=q_lens, context_lens_list=ctx, use_triton=True)
    got = paged_attention(q, k_cache, v_cache, meta, d ** -0.5, k, v).float()
    ref = paged_attention_ref(q, k_cache, v_cache, meta, d ** -0.5).float()
    assert (got - ref).abs().max().item() < 2e-2
