"""The overlap layer factory gives the stock factory's answers with the same weights, in both of its
layouts (sequence-parallel with AG-GEMM / GEMM-RS, and replicated with the IPC all-reduce), for
token counts below, at and above the world size; the counters prove the kernels ran."""

import json

import pytest
import torch
from torch import nn

from tp_overlap_plugin import stats
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.layers import TPGroup, TPLayers
from tp_overlap_plugin.multirank import run_ranks
from tp_overlap_plugin.options import TPOverlapOptions
from tp_overlap_plugin.overlap_layers import OverlapTPLayers, required_heap_bytes
from tp_overlap_plugin.overlap_plan import OverlapPlan

V, H, I = 50, 64, 96
TOKENS = (1, 3, 8, 13)
DTYPE = torch.float16


class _Block(nn.Module):
    """embedding -> column (gate_up) with its SiLU-mul -> row (down) -> residual add -> LM head: every
    module kind of the layer contract, composed as the model file composes them (gate_up without a
    bias, as Llama's: the flag's layers may then fuse the activation into the GEMM)."""

    GATE_UP_BIAS = False

    def __init__(self, f: TPLayers):
        super().__init__()
        self.embed = f.embedding(V, H)
        self.gate_up = f.column(H, [I, I], bias=self.GATE_UP_BIAS)
        self.down = f.row(I, H, bias=True)
        self.head = f.lm_head(V, H)

    def load(self, seed):
        g = torch.Generator().manual_seed(seed)
        w = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(DTYPE)  # noqa: E731
        self.embed.load_shard(w(V, H))
        self.gate_up.load_shard(w(I, H), 0)
        self.gate_up.load_shard(w(I, H), 1)
        if self.GATE_UP_BIAS:
            self.gate_up.load_shard(w(I), 0, is_bias=True)
            self.gate_up.load_shard(w(I), 1, is_bias=True)
        self.down.load_shard(w(H, I))
        self.down.load_shard(w(H), is_bias=True)
        self.head.load_shard(w(V, H))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(self.gate_up.silu_mul(h))
        return self.head(h, None)


class _NormBlock(_Block):
    """The decoder's row-layer epilogue as serving/model/model.py composes it: the row layer built with
    reduce_into_norm=True feeds the next RMSNorm with the residual, which in the replicated layout
    may take the all-reduce, the add and the norm as one kernel. Its gate_up has a bias (the
    column layers' bias path)."""

    GATE_UP_BIAS = True

    def __init__(self, f: TPLayers):
        super().__init__(f)
        from tp_overlap_plugin.serving.model.model import RMSNorm
        self.down = f.row(I, H, bias=True, reduce_into_norm=True)
        self.norm = RMSNorm(H, 1e-5, DTYPE, "cpu")

    def load(self, seed):
        super().load(seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.norm.weight.data = (1 + 0.1 * torch.randn(H, generator=g)).to(DTYPE)

    def forward(self, ids):
        h = self.embed(ids)
        normed, residual = self.norm(self.down(self.gate_up.silu_mul(h)), h)
        return self.head(normed + residual, None)


def _compare(ctx, seed, dispatch, block_name="_Block"):
    block = {"_Block": _Block, "_NormBlock": _NormBlock}[block_name]
    tp = TPGroup(ctx.rank, ctx.world_size, ctx.device_group)
    stock = block(TPLayers(tp, DTYPE, ctx.device))
    dispatch = dict(dispatch)
    capacity = dispatch.pop("all_reduce_capacity", None)
    plan = OverlapPlan(TPOverlapOptions(), "cpu", ctx.world_size, dispatcher=Dispatcher(**dispatch))
    layers = OverlapTPLayers(tp, DTYPE, ctx.device, ctx.heap, max_tokens=16, plan=plan)
    if capacity is not None:  # as if the steps' messages outgrew the all-reduce's heap slots
        layers.all_reduce.max_bytes = capacity
    overlap = block(layers)
    stock.load(seed)
    overlap.load(seed)
    out = []
    for t in TOKENS:
        ids = torch.randint(0, V, (t,), generator=torch.Generator().manual_seed(seed + t))
        out.append((t, stock(ids), overlap(ids)))
    ctx.heap.check()
    return out, stats.snapshot()


def _heap_size():
    return required_heap_bytes(OverlapPlan(TPOverlapOptions(), "cpu", 2, dispatcher=Dispatcher()), H, 16, DTYPE) // 16  # the all-reduce stage dominates; 8 MB is plenty


IPC_ALL_REDUCE = dict(mode="table", all_reduce=[{"bytes": 1, "graph_winner": "ipc", "eager_winner": "ipc"}])
# the fused all-reduce + norm measured faster up to 3 rows, slower from 8 (as hidden 8192 at TP=4 on H200
# is at every row count): 1 and 3 tokens run it, 8 and 13 our all-reduce and then the add + norm kernel
FUSED_NORM_TO_3 = dict(IPC_ALL_REDUCE, norm_rows=[
    {"hidden": H, "tokens": t, "graph_winner": w, "eager_winner": w}
    for t, w in ((1, "fused"), (3, "fused"), (8, "unfused"), (16, "unfused"))])
# the table says ipc at every size, but 13 tokens' rows (1664 bytes) are more than the op holds: stock
# in place for those, never the op's copying fallback
IPC_CAPPED = dict(IPC_ALL_REDUCE, all_reduce_capacity=1024)
# the down projection (K = I / 2 per rank, N = H) measured a win for GEMM + all-reduce from M = 1 up
GEMM_AR = dict(IPC_ALL_REDUCE, gemm_all_reduce_rows=[
    {"M": 1, "K": I // 2, "N": H, **{k: "gemm_ar" for k in ("graph_winner", "eager_winner", "norm_graph_winner",
                                                            "norm_eager_winner")}}])


# gate_up with its SiLU-mul fused measured a win from M = 1 up; the GEMV wins below 8 rows except for
# gate_up above 1 row; AG-GEMM loses to the sequential all-gather + GEMM at 8 rows, GEMM-RS wins by enough
# to shard the layer there. So: 1 and 3 tokens replicated, the other layers by the GEMV, gate_up fused in
# the decode matmul (the interpreter's FMA path takes up to 4 rows), whether or not its plain GEMV won;
# 8 and 13 sharded, gate_up fused in our GEMM on the gathered rows, down by GEMM-RS.
GEMV_SILU_SHARDED = dict(IPC_ALL_REDUCE, gemv_rows=[
    {"M": m, "K": k, "N": n, "winner": "gemv" if m < (4 if (k, n) == (H, I) else 8) else "stock"}
    for m in (1, 4, 8) for k, n in ((H, I), (I // 2, H), (H, -(-V // 2)))],
    silu_mul_rows=[{"M": 1, "K": H, "N": I, "winner": "fused"}],
    gemm=[{"op": "ag", "M": 8, "K": H, "N": I, "sequential_ms": 1.0, "ours_ms": 2.0, "winner": "stock"},
          {"op": "rs", "M": 8, "K": I // 2, "N": H, "sequential_ms": 10.0, "ours_ms": 1.0, "winner": "overlap"}])


@pytest.mark.parametrize("dispatch, block", [(dict(mode="overlap"), _Block),
                                             (dict(mode="overlap", fused_ops="chunked"), _NormBlock),
                                             (IPC_ALL_REDUCE, _Block),
                                             (FUSED_NORM_TO_3, _NormBlock), (dict(mode="stock"), _NormBlock),
                                             (GEMM_AR, _Block), (GEMM_AR, _NormBlock),
                                             (GEMV_SILU_SHARDED, _Block), (IPC_CAPPED, _Block)],
                         ids=["sequence_parallel", "sequence_parallel_chunked", "replicated_ipc_all_reduce", "replicated_fused_norm",
                              "stock_norm", "replicated_gemm_all_reduce", "replicated_gemm_all_reduce_norm",
                              "gemv_gemm_silu_mul", "replicated_over_capacity"])
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
            op = "chunked_" if dispatch.get("fused_ops") == "chunked" else ""
            assert counts[f"{op}ag.kernel" if op else "ag_gemm.kernel"] == len(TOKENS), counts
            assert counts[f"{op}rs.kernel" if op else "gemm_rs.kernel"] == len(TOKENS), counts
        elif dispatch["mode"] == "stock":
            assert not any(k.startswith(("all_reduce", "ag_gemm", "gemm_rs")) for k in counts), counts
        elif "silu_mul_rows" in dispatch:  # GEMV_SILU_SHARDED's paths, step by step (see there)
            assert counts["layers.replicated_steps"] == 2 and counts["layers.sequence_parallel_steps"] == 2, counts
            assert counts["gemv.kernel"] == 2 + 2 and counts["gemv_silu_mul.kernel"] == 2, counts
            assert counts["gemm_silu_mul.kernel"] == 2, counts
            assert counts["ag_gemm.sequential"] == 2 and counts["gemm_rs.kernel"] == 2, counts
            assert "ag_gemm.kernel" not in counts and counts["all_reduce.one_shot"] == 2, counts
        else:
            assert counts["layers.replicated_steps"] == len(TOKENS)
            assert "ag_gemm.kernel" not in counts
            assert "gemv.kernel" not in counts, counts
            if "gemm_all_reduce_rows" in dispatch:  # one kernel for the GEMM and the all-reduce; a norm adds itself
                assert counts["gemm_all_reduce.kernel"] == len(TOKENS)
                assert not any(k.startswith("all_reduce") for k in counts), counts
            elif block is _NormBlock:  # one fused kernel instead of the all-reduce and the norm where it won
                assert counts["all_reduce_norm.kernel"] == 2 and counts["all_reduce.one_shot"] == 2, counts
            elif "all_reduce_capacity" in dispatch:
                assert counts["all_reduce.one_shot"] == len(TOKENS) - 1 and "all_reduce.fallback" not in counts, counts
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
    fused = [{"hidden": 4096, "tokens": 1, "graph_winner": "fused", "eager_winner": "fused"}]
    d = Dispatcher(gemm_all_reduce_rows=rows, norm_rows=fused)
    assert d.may_use_kernels
    assert [d.gemm_all_reduce(m, 2048, 4096, True) for m in (1, 4, 16, 17, 64, 128)] == [True, True, True, False,
                                                                                         False, False]
    # feeding a norm: against the fused all-reduce + norm where the table runs it, else against the plain
    # all-reduce (the norm kernel after it is the same on both sides)
    assert [d.gemm_all_reduce(m, 2048, 4096, True, into_norm=True) for m in (1, 8, 9)] == [True, True, False]
    plain = Dispatcher(gemm_all_reduce_rows=rows)
    assert [plain.gemm_all_reduce(m, 2048, 4096, True, into_norm=True) for m in (1, 8, 9, 16, 17)] == [True] * 4 + [False]
    assert not d.gemm_all_reduce(1, 2048, 4096, False) and not d.gemm_all_reduce(1, 7168, 4096, True)
    assert not Dispatcher(gemm_all_reduce_rows=[dict(rows[1])]).gemm_all_reduce(1, 2048, 4096, True)
    assert not Dispatcher.load("table", device_name="NVIDIA H200", world=2).gemm_all_reduce(1, 2048, 4096, True)


def test_tables_with_the_removed_fused_norm_columns_still_load(tmp_path):
    """Tables written while GEMM + all-reduce + RMSNorm as one kernel existed (removed: it lost at every
    measured row) hold its fused_norm columns: they load, those columns are ignored, and the rest of
    each row still decides."""
    old = {"fused_norm_graph_winner": "fused", "fused_norm_eager_winner": "fused", "fused_norm_graph_us": 9.0,
           "fused_norm_graph_best_stock_us": 10.0, "fused_norm_graph_ratio": 1.1}
    rows = [{"M": m, "K": 2048, "N": 4096, "graph_winner": "stock", "eager_winner": "stock",
             "norm_graph_winner": "gemm_ar" if m <= 8 else "stock", "norm_eager_winner": "stock", **old}
            for m in (1, 8, 64)]
    path = tmp_path / "old.json"
    # (the fused all-reduce + norm runs at this hidden size, so the "+norm" columns decide)
    fused = [{"hidden": 4096, "tokens": 1, "graph_winner": "fused", "eager_winner": "fused"}]
    path.write_text(json.dumps({"device": "cpu", "world": 2, "margin": 1.02, "gemm": [], "all_reduce": [],
                                "gemm_all_reduce": rows, "all_reduce_norm": fused}))
    d = Dispatcher.load("table", device_name="cpu", world=2, path=path)
    assert d.gemm_all_reduce_rows == rows, d.source
    assert [d.gemm_all_reduce(m, 2048, 4096, True, into_norm=True) for m in (1, 8, 9)] == [True, True, False]
    assert not d.gemm_all_reduce(1, 2048, 4096, True)
    # where only the removed columns said "fused", nothing of ours runs
    stock = [dict(r, norm_graph_winner="stock") for r in rows]
    assert not Dispatcher(gemm_all_reduce_rows=stock).may_use_kernels


def test_fused_norm_rule():
    """The fused all-reduce + norm where the measured row counts on both sides won, per hidden size and
    mode; unmeasured hidden sizes, and tables from before the section, run our all-reduce and then the
    norm. The shipped H200 TP=4 table, from its store: hidden 4096 fused at 1 to 8 rows, not from 32 (one
    repeat of three lost there, 0.99) nor between (the more cautious neighbour); hidden 8192 (70B), which
    lost at every row count, never."""
    rows = [{"hidden": 64, "tokens": t, "graph_winner": "fused" if t <= 32 else "unfused", "eager_winner": "unfused"}
            for t in (1, 8, 32, 128)]
    d = Dispatcher(norm_rows=rows)
    assert [d.fused_norm(64, t, True) for t in (1, 5, 32, 33, 128, 500)] == [True, True, True, False, False, False]
    assert not d.fused_norm(64, 1, False) and not d.fused_norm(128, 1, True)
    assert Dispatcher(mode="overlap").fused_norm(64, 1, True) and not Dispatcher(mode="stock").fused_norm(64, 1, True)
    assert not Dispatcher(all_reduce=IPC_ALL_REDUCE["all_reduce"]).fused_norm(64, 1, True)
    tp4 = Dispatcher.load("table", device_name="NVIDIA H200", world=4)
    assert [tp4.fused_norm(4096, t, True) for t in (1, 8, 9, 32, 128, 256)] == [True] * 2 + [False] * 4
    assert not any(tp4.fused_norm(8192, t, True) for t in (1, 8, 64, 256))
    tp2 = Dispatcher.load("table", device_name="NVIDIA H200", world=2)
    assert all(tp2.fused_norm(4096, t, True) for t in (1, 8, 64, 256))


def test_gemm_silu_mul_rule():
    """Fused where the measured points on both sides of M won. The shipped H100 TP=1 table: at the
    64 rows where it measured a win only (bench/results/gemm-silu-mul-h100-*), stock at every other
    size, prefill's included, and for shapes it did not measure."""
    d = Dispatcher.load("table", device_name="NVIDIA H100 80GB HBM3", world=1)
    assert d.gemm_silu_mul(64, 4096, 28672) and d.may_use_kernels
    assert not any(d.gemm_silu_mul(m, 4096, 28672) for m in (1, 63, 65, 256, 1024, 8192))
    assert not d.gemm_silu_mul(64, 4096, 14336)
    rows = [{"M": m, "K": 8, "N": 16, "winner": "fused" if m >= 256 else "stock"} for m in (64, 256, 1024)]
    assert [Dispatcher(silu_mul_rows=rows).gemm_silu_mul(m, 8, 16) for m in (32, 64, 255, 256, 4096)] == [
        False, False, False, True, True]
    assert Dispatcher(mode="overlap").gemm_silu_mul(1, 8, 16) and not Dispatcher(mode="stock").gemm_silu_mul(256, 8, 16)


def test_measured_table_choices():
    """The shipped H200 table: every measured point dispatches to its measured winner, and the
    layout and all-reduce choices its evidence shows (bench/results/tune-llama-3-8b-tp2-h200x2-2026-11-28.md) hold."""
    d = Dispatcher.load("table", device_name="NVIDIA H200", world=2)
    assert d.gemm and d.all_reduce and d.margin >= 1.0
    for r in d.gemm:
        assert d.fused_gemm(r["op"], r["M"], r["K"], r["N"]) == (r["winner"] == "overlap"), r
        # ours only where it won by the margin in every interleaved repeat (the ratio's min), where repeats ran
        lowest = r["ratio"][0] if "ratio" in r else r["sequential_ms"] / r["ours_ms"]
        assert (r["winner"] == "overlap") == (lowest >= d.margin), r
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
