"""The overlap layer factory gives the stock factory's answers with the same weights, in both of its
layouts (sequence-parallel with AG-GEMM / GEMM-RS, and replicated with the IPC all-reduce), for
token counts below, at and above the world size; the counters prove the kernels ran."""

import pytest
import torch
from torch import nn

from tp_overlap_plugin import stats
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.layers import TPGroup, TPLayers
from tp_overlap_plugin.multirank import run_ranks
from tp_overlap_plugin.overlap_layers import OverlapTPLayers, required_heap_bytes

V, H, I = 50, 64, 96
TOKENS = (1, 3, 8, 13)
DTYPE = torch.float16


class _Block(nn.Module):
    """embedding -> column (gate_up) -> SiLU-gate -> row (down) -> residual add -> LM head: every
    module kind of the layer contract, composed as the model file composes them."""

    def __init__(self, f: TPLayers):
        super().__init__()
        self.embed = f.embedding(V, H)
        self.gate_up = f.column(H, [I, I], bias=True)
        self.down = f.row(I, H, bias=True)
        self.head = f.lm_head(V, H)

    def load(self, seed):
        g = torch.Generator().manual_seed(seed)
        w = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(DTYPE)  # noqa: E731
        self.embed.load_shard(w(V, H))
        self.gate_up.load_shard(w(I, H), 0)
        self.gate_up.load_shard(w(I, H), 1)
        self.gate_up.load_shard(w(I), 0, is_bias=True)
        self.gate_up.load_shard(w(I), 1, is_bias=True)
        self.down.load_shard(w(H, I))
        self.down.load_shard(w(H), is_bias=True)
        self.head.load_shard(w(V, H))

    def forward(self, ids):
        h = self.embed(ids)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        h = h + self.down(nn.functional.silu(gate) * up)
        return self.head(h, None)


class _NormBlock(_Block):
    """The decoder's row-layer epilogue as serving/model.py composes it: the row layer built with
    reduce_into_norm=True feeds the next RMSNorm with the residual, which in the replicated layout
    may take the all-reduce, the add and the norm as one kernel."""

    def __init__(self, f: TPLayers):
        super().__init__(f)
        from tp_overlap_plugin.serving.model import RMSNorm
        self.down = f.row(I, H, bias=True, reduce_into_norm=True)
        self.norm = RMSNorm(H, 1e-5, DTYPE, "cpu")

    def load(self, seed):
        super().load(seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.norm.weight.data = (1 + 0.1 * torch.randn(H, generator=g)).to(DTYPE)

    def forward(self, ids):
        h = self.embed(ids)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        normed, residual = self.norm(self.down(nn.functional.silu(gate) * up), h)
        return self.head(normed + residual, None)


def _compare(ctx, seed, dispatch, block_name="_Block"):
    block = {"_Block": _Block, "_NormBlock": _NormBlock}[block_name]
    tp = TPGroup(ctx.rank, ctx.world_size, ctx.device_group)
    stock = block(TPLayers(tp, DTYPE, ctx.device))
    dispatcher = Dispatcher(**dispatch)
    overlap = block(OverlapTPLayers(tp, DTYPE, ctx.device, ctx.heap, max_tokens=16, dispatcher=dispatcher))
    stock.load(seed)
    overlap.load(seed)
    out = []
    for t in TOKENS:
        ids = torch.randint(0, V, (t,), generator=torch.Generator().manual_seed(seed + t))
        out.append((t, stock(ids), overlap(ids)))
    ctx.heap.check()
    return out, stats.snapshot()


def _heap_size():
    return required_heap_bytes(H, 16, 2, DTYPE) // 16  # the all-reduce stage dominates; 8 MB is plenty


IPC_ALL_REDUCE = dict(mode="table", all_reduce=[{"bytes": 1, "graph_winner": "ipc", "eager_winner": "ipc"}])
# the down projection (K = I / 2 per rank, N = H) measured a win for GEMM + all-reduce from M = 1 up
GEMM_AR = dict(IPC_ALL_REDUCE, gemm_all_reduce_rows=[
    {"M": 1, "K": I // 2, "N": H, **{k: "gemm_ar" for k in ("graph_winner", "eager_winner", "norm_graph_winner",
                                                            "norm_eager_winner")}}])


# our GEMV measured a win at 1 and 4 rows and a loss at 8 for every local matmul of a rank (column:
# K = H, N = I; row: K = I / 2, N = H; head: K = H, N = V / 2), so it runs at 1 and 3 tokens only
GEMV_WINS_BELOW_8 = dict(IPC_ALL_REDUCE, gemv_rows=[
    {"M": m, "K": k, "N": n, "winner": "gemv" if m < 8 else "stock"}
    for m in (1, 4, 8) for k, n in ((H, I), (I // 2, H), (H, -(-V // 2)))])


@pytest.mark.parametrize("dispatch, block", [(dict(mode="overlap"), _Block), (IPC_ALL_REDUCE, _Block),
                                             (IPC_ALL_REDUCE, _NormBlock), (dict(mode="stock"), _NormBlock),
                                             (GEMM_AR, _Block), (GEMM_AR, _NormBlock), (GEMV_WINS_BELOW_8, _Block)],
                         ids=["sequence_parallel", "replicated_ipc_all_reduce", "replicated_fused_norm",
                              "stock_norm", "replicated_gemm_all_reduce", "replicated_gemm_all_reduce_norm",
                              "replicated_gemv"])
def test_overlap_layers_match_stock(dispatch, block):
    seed = int(torch.randint(0, 2**30, ()))
    results = run_ranks(_compare, 2, (seed, dispatch, block.__name__), heap_size=64 << 20, timeout=300)
    for out, counts in results:
        for t, ref, got in out:
            assert got.shape == ref.shape == (t, V)
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 2e-3, (t, err)  # fp16 rounding alone: ~3e-4 here
        if dispatch["mode"] == "overlap":
            assert counts["layers.sequence_parallel_steps"] == len(TOKENS)
            assert counts["ag_gemm.kernel"] == len(TOKENS) and counts["gemm_rs.kernel"] == len(TOKENS)
        elif dispatch["mode"] == "stock":
            assert not any(k.startswith(("all_reduce", "ag_gemm", "gemm_rs")) for k in counts), counts
        else:
            assert counts["layers.replicated_steps"] == len(TOKENS)
            assert "ag_gemm.kernel" not in counts
            # three local matmuls per step (column, row, head) at 1 and 3 tokens
            assert counts.get("gemv.kernel", 0) == (3 * 2 if "gemv_rows" in dispatch else 0), counts
            if "gemm_all_reduce_rows" in dispatch:  # one kernel for the GEMM and the all-reduce; a norm adds itself
                assert counts["gemm_all_reduce.kernel"] == len(TOKENS)
                assert not any(k.startswith("all_reduce") for k in counts), counts
            elif block is _NormBlock:  # one fused kernel instead of the all-reduce and the norm
                assert counts["all_reduce_norm.kernel"] == len(TOKENS) and "all_reduce.one_shot" not in counts
            else:
                assert counts["all_reduce.one_shot"] == len(TOKENS)


# (op, K, N) of a Llama-3-8B layer at TP=2: qkv, o_proj, gate_up, down
LLAMA_8B_TP2 = [("ag", 4096, 3072), ("rs", 2048, 4096), ("ag", 4096, 14336), ("rs", 7168, 4096)]


def test_unmeasured_device_dispatches_everything_to_stock():
    d = Dispatcher.load("table", device_name="Some Future GPU", world=2)
    assert "no table" in d.source
    assert not d.fused_gemm("ag", 8192, 4096, 14336) and not d.ipc_all_reduce(8192, in_graph=True)
    assert not d.gemm_all_reduce(1, 2048, 4096, in_graph=True)


def test_gemm_all_reduce_rule():
    """Ours where the measured points on both sides of M won (at and above the largest measured M
    too), stock between a win and a loss, below the smallest M and for unmeasured shapes; the norm's
    and eager's columns are separate. The shipped H200 table has no measurement: stock."""
    rows = [{"M": m, "K": 2048, "N": 4096, "graph_winner": "gemm_ar" if m <= 16 else "stock",
             "eager_winner": "stock", "norm_graph_winner": "gemm_ar" if m <= 8 else "stock",
             "norm_eager_winner": "stock"} for m in (1, 8, 16, 64)]
    d = Dispatcher(gemm_all_reduce_rows=rows)
    assert d.may_use_kernels
    assert [d.gemm_all_reduce(m, 2048, 4096, True) for m in (1, 4, 16, 17, 64, 128)] == [True, True, True, False,
                                                                                         False, False]
    assert [d.gemm_all_reduce(m, 2048, 4096, True, into_norm=True) for m in (1, 8, 9)] == [True, True, False]
    assert not d.gemm_all_reduce(1, 2048, 4096, False) and not d.gemm_all_reduce(1, 7168, 4096, True)
    assert not Dispatcher(gemm_all_reduce_rows=[dict(rows[1])]).gemm_all_reduce(1, 2048, 4096, True)
    assert not Dispatcher.load("table", device_name="NVIDIA H200", world=2).gemm_all_reduce(1, 2048, 4096, True)


def test_measured_table_choices():
    """The shipped H200 table: every measured point dispatches to its measured winner, and the
    layout and all-reduce choices documented in bench/results/dispatch-h200-tp2-*.md hold."""
    d = Dispatcher.load("table", device_name="NVIDIA H200", world=2)
    assert d.gemm and d.all_reduce and d.margin >= 1.0
    for r in d.gemm:
        assert d.fused_gemm(r["op"], r["M"], r["K"], r["N"]) == (r["winner"] == "overlap"), r
        assert (r["winner"] == "overlap") == (r["sequential_ms"] >= d.margin * r["ours_ms"]), r
    # small M: everything stock (host costs of the fused ops dominate)
    assert not any(d.fused_gemm(op, m, k, n) for op, k, n in LLAMA_8B_TP2 for m in (1, 2, 16, 64, 256))
    assert not d.sequence_parallel(256, LLAMA_8B_TP2) and d.sequence_parallel(8192, LLAMA_8B_TP2)
    # decode all-reduce: each measured size goes to its measured winner, which in a graph is ours
    # (one-shot to 1 MB, then two-shot) at every size measured: 8 KB to 8 MB
    for r in d.all_reduce:
        assert d.ipc_all_reduce(r["bytes"], in_graph=True) == (r["graph_winner"] == "ipc"), r
        assert d.ipc_all_reduce(r["bytes"], in_graph=False) == (r["eager_winner"] == "ipc"), r
        assert r["algorithm"] == ("one_shot" if r["bytes"] <= 1 << 20 else "two_shot"), r
    assert all(d.ipc_all_reduce(b, in_graph=True) for b in (8 << 10, 1 << 20, 2 << 20, 8 << 20))


def test_layout_rule_weighs_the_whole_layer():
    rows = []
    for m, wins in ((1024, ()), (4096, ("qkv",)), (8192, ("qkv", "down"))):
        for name, (op, k, n) in zip(("qkv", "o", "gate_up", "down"), LLAMA_8B_TP2):
            seq = {"qkv": 1.0, "o": 1.0, "gate_up": 4.0, "down": 2.0}[name]
            ours = seq / 1.5 if name in wins else seq * 1.1
            rows.append({"op": op, "M": m, "K": k, "N": n, "sequential_ms": seq, "ours_ms": ours,
                         "winner": "overlap" if name in wins else "stock"})
    d = Dispatcher(gemm=rows)
    # M=4096: 8 ms sequential vs 7.67 with qkv fused: 1.04x, sharded; M=1024: nothing wins
    assert d.sequence_parallel(4096, LLAMA_8B_TP2) and d.sequence_parallel(8192, LLAMA_8B_TP2)
    assert not d.sequence_parallel(1024, LLAMA_8B_TP2) and not d.sequence_parallel(2048, LLAMA_8B_TP2)
    assert not d.sequence_parallel(4096, LLAMA_8B_TP2[:1] + [("ag", 1, 1)]), "an unmeasured op: no layout change"
    assert Dispatcher(mode="overlap").sequence_parallel(1, []) and not Dispatcher(mode="stock").sequence_parallel(1 << 20, [])
    with pytest.raises(ValueError, match="dispatch mode"):
        Dispatcher(mode="sometimes")
