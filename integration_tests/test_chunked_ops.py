"""The chunked fused ops (vendor GEMM per peer's block, copy-engine pulls on a side stream) on real
rank processes vs float64 references: shapes that are not tile multiples, M < W, M = 1, every call
repeated so the call number and the ready and pulled words advance, and the ops interleaved so a send
slot is rewritten only after every peer pulled it. Outputs are fresh per call; a row nobody wrote
would be the allocator's garbage, which the references catch. A rank that stops calling makes its
peers' waits give up with its rank named, and their outputs NaN, not a stale call's."""

import pytest
import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.multirank import run_ranks
from tp_overlap_plugin.ops.chunked import ChunkedAllGatherGemm, ChunkedGemmReduceScatter

AG_CASES = [(1, 40, 17), (5, 64, 48), (33, 40, 70)]  # rows per shard, K, N
RS_CASES = [(1, 40, 17), (3, 64, 130), (9, 40, 33), (70, 64, 20)]  # M, K, N


def _operands(seed, world, rows, k, n, dtype):
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(rows, k, generator=gen).to(dtype) for _ in range(world)],
            [torch.randn(k, n, generator=gen).to(dtype) for _ in range(world)])


def _cases(ctx, seed, dtype):
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    ag = {k: ChunkedAllGatherGemm(ctx.heap, max_rows=40, k=k, dtype=dtype) for k in (40, 64)}
    rs = {n: ChunkedGemmReduceScatter(ctx.heap, max_rows=40, n=n, dtype=dtype) for n in (17, 130, 33, 20)}
    out = []
    for rep in range(2):
        for i, ((rows, k, n), (m, rk, rn)) in enumerate(zip(AG_CASES + AG_CASES[:1], RS_CASES)):
            a, b = _operands(seed + 10 * i + rep, W, rows, k, n, dtype)
            c_ag = ag[k](a[r].to(dev), b[0].to(dev)).cpu()
            a, b = _operands(seed + 100 + 10 * i + rep, W, m, rk, rn, dtype)
            c_rs = rs[rn](a[r].to(dev), b[r].to(dev)).cpu()
            out.append((c_ag, c_rs))
    ctx.heap.check()
    return out, stats.snapshot()


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_chunked_ops_match_float64(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    results = run_ranks(_cases, world, (seed, dtype), device=device, heap_size=4 << 20, timeout=600)
    for r, (out, counts) in enumerate(results):
        j = 0
        for rep in range(2):
            for i, ((rows, k, n), (m, rk, rn)) in enumerate(zip(AG_CASES + AG_CASES[:1], RS_CASES)):
                c_ag, c_rs = out[j]
                j += 1
                a, b = _operands(seed + 10 * i + rep, world, rows, k, n, dtype)
                ref = torch.cat(a).double() @ b[0].double()
                assert c_ag.shape == ref.shape and _rel_err(c_ag, ref) < 1e-2, ("ag", r, rows, k, n, rep)
                a, b = _operands(seed + 100 + 10 * i + rep, world, m, rk, rn, dtype)
                full = sum(a[q].double() @ b[q].double() for q in range(world))
                pad = (-m) % world
                full = torch.cat([full, full.new_zeros(pad, rn)])
                rows_rs = (m + pad) // world
                ref = full[r * rows_rs:(r + 1) * rows_rs]
                assert c_rs.shape == ref.shape and _rel_err(c_rs, ref) < 1e-2, ("rs", r, m, rk, rn, rep)
        assert counts["chunked_ag.kernel"] == 2 * len(RS_CASES) and counts["chunked_rs.kernel"] == 2 * len(RS_CASES)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_ag_pulls_every_peer_at_once_where_each_peer_is_a_link_of_its_own(world, monkeypatch):
    """ops.device.pull_lanes: on CDNA (a link per peer) one pull stream per peer, so the AG does not take
    one link's bandwidth of W - 1; behind NVSwitch one stream, peer after peer."""
    from tp_overlap_plugin.ops import device as dev
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    assert dev.pull_lanes(gpu, world) == 1
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert dev.pull_lanes(gpu, world) == world - 1
    assert dev.pull_lanes(torch.device("cpu"), world) == 1   # the interpreter has no streams
