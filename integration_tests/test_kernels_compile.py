"""Every kernel compiles, without a GPU, to machine code for both of our targets: Hopper (sm_90,
where we measure) and CDNA3 (gfx942, MI300X, where we ship). One code path, checked on every CI run.
"""

import functools
import os
import re
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tp_overlap_plugin.kernels.all_reduce import one_shot_all_reduce_kernel, sub_block, two_shot_all_reduce_kernel
from tp_overlap_plugin.kernels.all_reduce_norm import all_reduce_rmsnorm_kernel, row_blocks
from tp_overlap_plugin.kernels.barrier import barrier_kernel
from tp_overlap_plugin.kernels.gemm import gemm_kernel
from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
from tp_overlap_plugin.kernels.gemm_ar import gemm_all_reduce_kernel
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel
from tp_overlap_plugin.kernels.gemv import gemv_kernel
from tp_overlap_plugin.kernels.chunked import (begin_call_kernel, nan_if_failed_kernel, reduce_rows_kernel,
                                                   signal_kernel, wait_ready_kernel)
from tp_overlap_plugin.kernels.layer_ops import rmsnorm_kernel, rope_cache_kernel, silu_mul_kernel
from tp_overlap_plugin.ops.all_reduce_norm import NORM_THREADS, norm_num_warps
from tp_overlap_plugin.ops.ag_gemm import AG_SEGMENTS
from tp_overlap_plugin.ops.gemm_rs import RS_CHUNKS
from tp_overlap_plugin.kernels import triton_compat
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def clock_kernel(out_ptr):
    """The wait bound's clock (kernels/triton_compat.py: clock_ns), on its own."""
    tl.store(out_ptr, triton_compat.clock_ns())

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}

_TILES = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "EVEN_K": True, "INTERPRET": False}
_PTR = {"TMA": False, "B_KMAJOR": False, "C_TMA": False, "SUBTILE": False, "WARP_SPEC": False, "SPLIT": False,
        "DEVICE_DESC": False, "SILU_MUL": False}
_GEMM = {**_TILES, "FLATTEN": True, **_PTR}
# the descriptor variants Hopper runs (B as a Linear weight, [N, K]): host-built descriptors, and
# warp-specialized with descriptors built in the kernel (pointer arguments)
_TMA = {**_PTR, "TMA": True, "B_KMAJOR": True}
_GEMM_TMA = {**_TILES, "FLATTEN": True, **_TMA, "C_TMA": True, "SUBTILE": True}
_GEMM_TMA_WS = {**_TILES, "FLATTEN": False, **_TMA, "C_TMA": True, "WARP_SPEC": True,
                "DEVICE_DESC": True}
_GEMM_SPLIT = {**_TILES, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "FLATTEN": False, **_TMA,
               "SPLIT": True}
# H100's table tile at M = 1024-2048 (tma 128x256x64 w8 s3 ctma) as ops.gemm.silu_mul_config launches it:
# half the table's BLOCK_N, not flattened
_GEMM_SILU = {**_GEMM_TMA, "BLOCK_N": 128, "SUBTILE": False, "FLATTEN": False, "SILU_MUL": True}
_GEMM_SPLIT_PTR = {**_GEMM_SPLIT, **_PTR, "SPLIT": True}


_GEMV_MMA_TMA = {**_TILES, "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 256, "GROUP_M": 1, "EVEN_K": False,
                 "FLATTEN": False, **_TMA, "SPLIT": True}
_GEMV_MMA_PTR = {**_GEMV_MMA_TMA, **_PTR, "BLOCK_M": 32, "SPLIT": True}


def _sig(params: str, extra: dict | None = None, constexprs=_TILES) -> dict:
    sig = {}
    for p in params.split():
        name, ty = p.split(":")
        sig[name] = ty
    sig.update(extra or {})
    sig.update({c: "constexpr" for c in constexprs})
    return sig


_GEMM_ARGS = ("a_ptr:*bf16 b_ptr:*bf16 c_ptr:*bf16 M:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 "
              "stride_bn:i32 stride_cm:i32 stride_cn:i32 c_desc:*bf16 split_ws_ptr:*fp32 split_count_ptr:*i32 "
              "split_k:i32")
_FUSED_TILES = {**_TILES, "EVEN_K": False, "WORLD": 4, "FLATTEN": True}  # odd K: the masked K loop
# AG-GEMM as the host launches it for K = 4096 (kernels/ag_gemm.py: pieces of 32 rows, 512-column steps)
_AG = {**_FUSED_TILES, "SEGMENTS": AG_SEGMENTS, "PIECE_ROWS": 32, "PUSH_COLS": 512}
_RS = {**_FUSED_TILES, "CHUNKS": RS_CHUNKS}
_ONE = {"rank": 1, "rows": 1, "WORLD": 2}
_FUSED_COMM = "rank:i32 heap_bases:*i64 error_ptr:*i64"
_AG_ARGS = ("a_ptr:*bf16 b_ptr:*bf16 c_ptr:*bf16 gathered_ptr:*bf16 counts_ptr:*i64 calls_ptr:*i64 rows:i32 N:i32 "
            "K:i32 stride_bk:i32 stride_bn:i32 slot_stride:i32 pushers:i32 join:i32 " + _FUSED_COMM)
_RS_ARGS = ("a_ptr:*bf16 b_ptr:*bf16 c_ptr:*bf16 recv_ptr:*bf16 rows:i32 N:i32 K:i32 stride_am:i32 stride_bk:i32 "
            "stride_bn:i32 slot_stride:i32 counts_ptr:*i64 calls_ptr:*i64 " + _FUSED_COMM)


def _tma_sig(constexprs: dict) -> dict:
    """gemm_kernel's signature with A, B (and C) as tensor descriptors of the tiles' block shapes."""
    bm, bn, bk = constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]
    c_cols = bn // 2 if constexprs["SUBTILE"] else bn
    sig = _sig(_GEMM_ARGS, None, constexprs)
    sig.update(a_ptr=f"tensordesc<bf16[{bm}, {bk}]>", b_ptr=f"tensordesc<bf16[{bn}, {bk}]>")
    if constexprs["C_TMA"]:
        sig["c_desc"] = f"tensordesc<bf16[{bm}, {c_cols}]>"
    return sig


KERNELS = {
    # the plain GEMM and AG-GEMM's per-shard GEMM (the same kernel with its waiting prologue)
    "gemm": (gemm_kernel, _sig(_GEMM_ARGS, None, _GEMM), _GEMM),
    "gemm_tma": (gemm_kernel, _tma_sig(_GEMM_TMA), _GEMM_TMA),
    "gemm_tma_ws": (gemm_kernel, _sig(_GEMM_ARGS, None, _GEMM_TMA_WS), _GEMM_TMA_WS, {"num_warps": 4}),
    # gate_up_proj with SiLU-mul in the epilogue: the table's 128x256 tile as the host runs it
    "gemm_silu_mul_tma": (gemm_kernel, _tma_sig(_GEMM_SILU), _GEMM_SILU, {"num_warps": 8, "num_stages": 3}),
    "gemm_split_k": (gemm_kernel, _tma_sig(_GEMM_SPLIT), _GEMM_SPLIT, {"num_warps": 4, "num_stages": 4}),
    "gemm_split_k_ptr": (gemm_kernel, _sig(_GEMM_ARGS, None, _GEMM_SPLIT_PTR), _GEMM_SPLIT_PTR, {"num_warps": 4}),
    # the fused ops: the same tiles in two loops each, waits between them, peer stores in them; with
    # 8 warps, as the config tables launch 128x256 tiles (at 4 warps the accumulator spills, which the
    # host never runs, and ptxas took minutes over it on CI's cores)
    "ag_gemm": (ag_gemm_kernel, _sig(_AG_ARGS, None, _AG), _AG, {"num_warps": 8}),
    "gemm_rs": (gemm_rs_kernel, _sig(_RS_ARGS, None, _RS), _RS, {"num_warps": 8}),
    # what the JIT compiles on rank 1 for one-row shards: Triton makes integer arguments equal to 1 constants
    "ag_gemm_rank1": (ag_gemm_kernel, _sig(_AG_ARGS, None, {**_AG, **_ONE}), {**_AG, **_ONE}, {"num_warps": 8}),
    "gemm_rs_rank1": (gemm_rs_kernel, _sig(_RS_ARGS, None, {**_RS, **_ONE}), {**_RS, **_ONE}, {"num_warps": 8}),
    # decode GEMV at one row (the JIT makes M == 1 a constant) with a bias and a K tail, as the layers launch it
    "gemv": (gemv_kernel, _sig("x_ptr:*bf16 w_ptr:*bf16 bias_ptr:*bf16 y_ptr:*bf16 M:i32 N:i32 K:i32 stride_xm:i32 "
                               "stride_wn:i32 stride_ym:i32", None,
                               ["M", "M_PAD", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "EVEN_K", "HAS_BIAS", "PDL",
                                "SILU_MUL"]),
             {"M": 1, "M_PAD": 1, "BLOCK_N": 16, "BLOCK_K": 256, "NUM_STAGES": 4, "EVEN_K": False, "HAS_BIAS": True,
              "PDL": False, "SILU_MUL": False},
             {"num_warps": 4, "num_stages": 4}),
    # with dependent launch, K a multiple of the tile (as every shipped model's): the first weight tile
    # before the wait (ops.gemv: dependent_launch)
    "gemv_pdl": (gemv_kernel, _sig("x_ptr:*bf16 w_ptr:*bf16 bias_ptr:*bf16 y_ptr:*bf16 M:i32 N:i32 K:i32 "
                                   "stride_xm:i32 stride_wn:i32 stride_ym:i32", None,
                                   ["M", "M_PAD", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "EVEN_K", "HAS_BIAS", "PDL",
                                    "SILU_MUL"]),
                 {"M": 1, "M_PAD": 1, "BLOCK_N": 16, "BLOCK_K": 256, "NUM_STAGES": 4, "EVEN_K": True,
                  "HAS_BIAS": True, "PDL": True, "SILU_MUL": False}, {"num_warps": 4, "num_stages": 4}),
    # gate_up at one row with its SiLU-mul in the epilogue (ops.gemv.gemv_silu_mul: half the table's block_n
    # in output columns, each program's gate and up rows interleaved)
    "gemv_silu_mul": (gemv_kernel, _sig("x_ptr:*bf16 w_ptr:*bf16 bias_ptr:*bf16 y_ptr:*bf16 M:i32 N:i32 K:i32 "
                                        "stride_xm:i32 stride_wn:i32 stride_ym:i32", None,
                                        ["M", "M_PAD", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "EVEN_K", "HAS_BIAS",
                                         "PDL", "SILU_MUL"]),
                      {"M": 1, "M_PAD": 1, "BLOCK_N": 8, "BLOCK_K": 256, "NUM_STAGES": 4, "EVEN_K": True,
                       "HAS_BIAS": False, "PDL": False, "SILU_MUL": True}, {"num_warps": 4, "num_stages": 4}),
    # the decode matmul's tensor-core path: the core with the operands swapped (A = the weight, 64 rows a
    # tile; B = x^T, 16 columns, x's row count N == 1 made a constant by the JIT; C = y^T, unit row
    # stride), split-K, through descriptors and through pointers
    "gemv_mma_tma": (gemm_kernel, {**_tma_sig(_GEMV_MMA_TMA), "N": "constexpr", "stride_cm": "constexpr"},
                     {**_GEMV_MMA_TMA, "N": 1, "stride_cm": 1}, {"num_warps": 4, "num_stages": 4}),
    "gemv_mma_ptr": (gemm_kernel, {**_sig(_GEMM_ARGS, None, _GEMV_MMA_PTR), "N": "constexpr", "stride_cm": "constexpr",
                                   "stride_ak": "constexpr", "stride_bk": "constexpr"},
                     {**_GEMV_MMA_PTR, "N": 1, "stride_cm": 1, "stride_ak": 1, "stride_bk": 1},
                     {"num_warps": 4, "num_stages": 4}),
    "rmsnorm": (rmsnorm_kernel, _sig("x_ptr:*bf16 res_ptr:*bf16 out_ptr:*bf16 res_out_ptr:*bf16 w_ptr:*bf16 "
                                     "stride_x:i32 stride_res:i32 stride_out:i32 stride_res_out:i32 n:i32 eps:fp32",
                                     None, ["HAS_RES", "BLOCK"]), {"HAS_RES": True, "BLOCK": 4096}),
    "rope_cache": (rope_cache_kernel,
                   _sig("qkv_ptr:*bf16 stride_t:i32 positions_ptr:*i64 cos_ptr:*fp32 sin_ptr:*fp32 stride_pos:i32 "
                        "k_cache_ptr:*bf16 v_cache_ptr:*bf16 slot_ptr:*i64 stride_slot:i32", None,
                        ["Q_HEADS", "KV_HEADS", "HEADS_P2", "HALF"]),
                   {"Q_HEADS": 32, "KV_HEADS": 8, "HEADS_P2": 64, "HALF": 64}),
    "silu_mul": (silu_mul_kernel, _sig("x_ptr:*bf16 out_ptr:*bf16 stride_x:i32 stride_out:i32 n:i32", None, ["BLOCK"]),
                 {"BLOCK": 1024}),
    "barrier": (barrier_kernel, _sig("flags_ptr:*i64 epoch_ptr:*i64 rank:i32 heap_bases:*i64 error_ptr:*i64", None,
                                     ["WORLD", "POLL_LOAD"]), {"WORLD": 4, "POLL_LOAD": ""}),
    "clock": (clock_kernel, {"out_ptr": "*i64"}, {}),
    # the chunked fused ops' signals (kernels/chunked.py) at 4 ranks, as ops/chunked.py launches them
    # (every argument fixed per op, so integers are compiled as the first call's: dst -1, src 1), and
    # RS's sum
    "chunked_begin": (begin_call_kernel, _sig("pulled_ptr:*i64 calls_ptr:*i64 " + _FUSED_COMM, None,
                                              ["WORLD", "POLL_LOAD"]), {"WORLD": 4, "POLL_LOAD": ""}),
    "chunked_begin_w8": (begin_call_kernel, _sig("pulled_ptr:*i64 calls_ptr:*i64 " + _FUSED_COMM, None,
                                                 ["WORLD", "POLL_LOAD"]), {"WORLD": 8, "POLL_LOAD": ""}),
    "chunked_signal": (signal_kernel, _sig("flags_ptr:*i64 calls_ptr:*i64 " + _FUSED_COMM + " dst:i32", None,
                                           ["WORLD"]), {"WORLD": 4}),
    # at 8 ranks: a signal to every peer is still one releasing atomic (test_signals_to_every_peer_...)
    "chunked_signal_w8": (signal_kernel, _sig("flags_ptr:*i64 calls_ptr:*i64 " + _FUSED_COMM + " dst:i32", None,
                                              ["WORLD"]), {"WORLD": 8}),
    "chunked_wait": (wait_ready_kernel, _sig("ready_ptr:*i64 calls_ptr:*i64 src:i32 " + _FUSED_COMM, None, []), {}),
    "chunked_nan_if_failed": (nan_if_failed_kernel, _sig("out_ptr:*bf16 numel:i32 keep_start:i32 keep_end:i32 "
                                                         "error_ptr:*i64", None, ["BLOCK"]), {"BLOCK": 1024}),
    "chunked_reduce": (reduce_rows_kernel, _sig("own_ptr:*bf16 landed_ptr:*bf16 out_ptr:*bf16 rows:i32 N:i32 "
                                                "slot_stride:i32 rank:i32 error_ptr:*i64", None,
                                                ["WORLD", "BLOCK_M", "BLOCK_N"]),
                       {"WORLD": 4, "BLOCK_M": 32, "BLOCK_N": 128}),
}
# The all-reduces (kernels/all_reduce.py, all_reduce_norm.py): arrival marked in the data, 16-byte
# vectors to and from peers; checked at 2 and 8 ranks (receive tiles of 1 and 8 peers).
_LAMPORT = {"rank": "i32", "heap_bases": "*i64", "error_ptr": "*i64"}
_SLOTS = {"x_ptr": 16, "out_ptr": 16, "slots_ptr": 16, "scatter_ptr": 16, "gather_ptr": 16, "res_ptr": 16,
          "res_out_ptr": 16, "n": 16, "slot_stride": 16, "src_stride": 16, "scatter_slot_stride": 16,
          "scatter_src_stride": 16, "gather_slot_stride": 16, "row_stride": 16, "stride_x": 16, "stride_res": 16,
          "stride_out": 16, "stride_res_out": 16, "N": 16, "K": 16, "stride_om": 16, "stride_bn": 16,
          "stride_am": 16, "a_ptr": 16, "b_ptr": 16, "bias_ptr": 16, "calls_ptr": 16, "gathered_ptr": 16,
          "w_ptr": 16, "y_ptr": 16, "stride_wn": 16}
_CACHE = {"PEER_STORE": "", "POLL_LOAD": ""}
for _w, _peers in ((2, 1), (8, 8)):
    _sub = sub_block(4096, _w, 8 * 32)  # what ops/all_reduce.py launches on NVIDIA (8 warps)
    _cx = {"WORLD": _w, "BLOCK": 4096, **_CACHE}
    KERNELS[f"one_shot_all_reduce_bf16_w{_w}"] = (
        one_shot_all_reduce_kernel,
        _sig("x_ptr:*bf16 out_ptr:*bf16 slots_ptr:*i16 epoch_ptr:*i64 n:i32 slot_stride:i32 src_stride:i32", _LAMPORT,
             ["WORLD", "PEERS", "BLOCK", "SUB", *_CACHE]), {**_cx, "PEERS": _peers, "SUB": _sub}, {"num_warps": 8})
    KERNELS[f"two_shot_all_reduce_bf16_w{_w}"] = (
        two_shot_all_reduce_kernel,
        _sig("x_ptr:*bf16 out_ptr:*bf16 scatter_ptr:*i16 gather_ptr:*i16 epoch_ptr:*i64 n:i32 scatter_slot_stride:i32 "
             "scatter_src_stride:i32 gather_slot_stride:i32", _LAMPORT, ["WORLD", "BLOCK", *_CACHE]), _cx,
        {"num_warps": 8})
    KERNELS[f"all_reduce_rmsnorm_bf16_w{_w}"] = (
        all_reduce_rmsnorm_kernel,
        _sig("x_ptr:*bf16 res_ptr:*bf16 w_ptr:*bf16 bias_ptr:*bf16 out_ptr:*bf16 res_out_ptr:*bf16 slots_ptr:*i16 "
             "push_epoch_ptr:*i64 row_epoch_ptr:*i64 rows:i32 n:i32 stride_x:i32 stride_res:i32 stride_out:i32 "
             "stride_res_out:i32 slot_stride:i32 src_stride:i32 row_stride:i32 eps:fp32", _LAMPORT,
             ["WORLD", "PEERS", "BLOCK", "SUB", "ONE_TILE", "HAS_BIAS", *_CACHE]),
        # at 2 ranks an 8192-wide row is one receive tile, normalised from registers; at 8, four
        {**_cx, "PEERS": _peers, "SUB": row_blocks(8192, _w, 2, NORM_THREADS)[1], "ONE_TILE": _w == 2, "HAS_BIAS": True},
        lambda target: {"num_warps": norm_num_warps(target.warp_size)})
# GEMM + all-reduce (kernels/gemm_ar.py): decode tiles (16 rows, narrow N, long K blocks), the
# all-reduce's exchange in the epilogue; at 2 ranks on rank 1 with M = 1 (both made constants by
# the JIT; 128 columns, so a thread holds 16 bytes of a tile on CDNA too) and at 8 ranks (receive sub-blocks of
# 16 rows for 64-row tiles). B is an nn.Linear
# weight: its K stride is 1, which the JIT makes a constant too.
_GEMM_AR_ARGS = ("a_ptr:*bf16 b_ptr:*bf16 bias_ptr:*bf16 out_ptr:*bf16 slots_ptr:*i16 calls_ptr:*i64 M:i32 N:i32 K:i32 "
                 "stride_am:i32 stride_bk:i32 stride_bn:i32 stride_om:i32 slot_stride:i32 src_stride:i32 row_stride:i32")
_GEMM_AR_CX = ["WORLD", "PEERS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SUB_M", "GROUP_M", "EVEN_K", "INTERPRET", "HAS_BIAS",
               *_CACHE]
for _name, _w, _peers, _bm, _bn, _bk, _sub, _one in (("gemm_all_reduce_bf16_w2", 2, 1, 16, 128, 256, 16,
                                                      {"rank": 1, "M": 1}),
                                                     ("gemm_all_reduce_bf16_w8", 8, 8, 64, 32, 128, 16, {})):
    _one = {"stride_bk": 1, **_one}
    _cx = {"WORLD": _w, "PEERS": _peers, "BLOCK_M": _bm, "BLOCK_N": _bn, "BLOCK_K": _bk, "SUB_M": _sub, "GROUP_M": 4,
           "EVEN_K": False, "INTERPRET": False, "HAS_BIAS": True, **_CACHE, **_one}
    KERNELS[_name] = (gemm_all_reduce_kernel, _sig(_GEMM_AR_ARGS, _LAMPORT, _GEMM_AR_CX + list(_one)), _cx,
                      {"num_warps": 4, "num_stages": 4 if _bm == 16 else 3})
LAMPORT = sorted(k for k in KERNELS if "all_reduce" in k)
# kernels compiled as a launch with aligned operands sees them (heap slots, K and strides divisible by 16)
ALIGNED = LAMPORT + ["ag_gemm", "gemv_pdl"]


@functools.lru_cache(maxsize=None)
def _compiled(name, target):
    fn, signature, constexprs, *options = KERNELS[name]
    attrs = None
    if name in ALIGNED:
        # what Triton sees at a real launch: heap pointers, lengths and strides divisible by 16
        names = list(signature)
        attrs = {(names.index(a),): [["tt.divisibility", d]] for a, d in _SLOTS.items() if a in signature}
        if target == "gfx942" and name in LAMPORT:  # what ops/all_reduce.py passes on ROCm
            constexprs = {**constexprs, "PEER_STORE": ".wt", "POLL_LOAD": ".cv"}
    if target == "gfx942" and "POLL_LOAD" in constexprs:  # ops.device.cache_modifiers on ROCm
        constexprs = {**constexprs, "POLL_LOAD": ".cv"}
    options = options[0] if options else None
    if callable(options):  # options that depend on the target (its warp size)
        options = options(TARGETS[target])
    return triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=TARGETS[target], options=options)


# The rank-1 variants test Triton's specialization of integer arguments equal to 1, which happens before
# any target's backend: one target is enough (they cost CI ~20 s each on gfx942).
FRONTEND_ONLY = {"ag_gemm_rank1", "gemm_rs_rank1"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("name,target", [(n, t) for n in sorted(KERNELS) for t in sorted(TARGETS)
                                         if n not in FRONTEND_ONLY or t == "sm90"])
def test_kernel_compiles_for_target(name, target):
    binary = "cubin" if target == "sm90" else "hsaco"
    assert _compiled(name, target).asm.get(binary), f"{name}: no {binary} produced for {target}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
def test_gemm_silu_mul_wgmmas_stay_asynchronous():
    """The fused gate_up's two accumulators: ptxas serializes their wgmmas when the tile loop is
    flattened (its warning C7515; ~25% slower on H100, bench/notes/gemm.md), so ops.gemm.silu_mul_config
    launches it unflattened, where they must stay asynchronous."""
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(_compiled("gemm_silu_mul_tma", "sm90").asm["ptx"])
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "C7515" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


WAITING = ("chunked_wait", "ag_gemm", "gemm_rs")   # rma.signal_wait: one flag
WAITING_MANY = ("barrier", "chunked_begin", "chunked_begin_w8")  # rma.signal_wait_ranks: a flag per rank at once


def _spin_loops(ttgir: str):
    """(text of each spin loop, the text after it up to the next scf.if): an innermost scf.while
    that polls with volatile loads"""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.while" not in line:
            continue
        depth, j = 0, i
        while True:
            depth += lines[j].count("{") - lines[j].count("}")
            if depth == 0 and j > i:
                break
            j += 1
        rest = "\n".join(lines[j + 1:])
        body = "\n".join(lines[i + 1:j + 1])
        if "scf.while" in body or "isVolatile = true" not in body:
            continue
        yield "\n".join(lines[i:j + 1]), rest.split("scf.if", 1)[0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", WAITING)
def test_a_wait_decides_once_for_all_threads(name, target):
    """Threads of rma.signal_wait poll on their own and may leave the loop at different polls; the
    branches after it hold CTA barriers. So the loop must hold no barrier (nor an atomic, which
    brings one), and the decision must come from a scalar atomic, which one thread performs and
    Triton broadcasts, not from a scalar load, which Triton assumes uniform without making it so."""
    loops = list(_spin_loops(_compiled(name, target).asm["ttgir"]))
    assert loops, f"{name}: no spin loop found"
    for loop, after in loops:
        assert "gpu.barrier" not in loop and "tt.atomic" not in loop, f"{name}: a barrier inside the spin"
        assert re.search(r"tt\.atomic_rmw .*-> i64\b", after), f"{name}: the decision is not a scalar atomic"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", WAITING_MANY)
def test_a_wait_for_every_rank_decides_once_for_all_threads(name, target):
    """rma.signal_wait_ranks polls a flag per rank together. The loop carries one scalar state, a reduction
    over the polled flags with each thread's clock and error-slot reading folded in, so every thread runs
    the same polls (the reduction's shuffles and barriers are met by all); a scalar load or clock in the
    condition itself would let threads leave at different polls. The decision after the loop is a
    reduction of one acquiring atomic read per flag."""
    loops = list(_spin_loops(_compiled(name, target).asm["ttgir"]))
    assert loops, f"{name}: no spin loop found"
    for loop, after in loops:
        head, body = loop.split("} do {", 1)
        assert re.search(r"scf\.while \([^)]*\) : \(i32\)", head), f"{name}: the loop does not carry one scalar state"
        assert "gpu.barrier" not in loop and "tt.atomic" not in loop, f"{name}: a barrier inside the spin"
        # a volatile block load, or on CDNA the buffer load Triton makes of it, keeping the coherent modifier
        assert (re.search(r"tt\.load .*isVolatile = true.* : tensor<", body)
                or re.search(r"amdg\.buffer_load .*cache_?[mM]odifier = cv.*tensor<", body)), \
            f"{name}: the spin does not poll a block of flags coherently"
        assert re.search(r"\"tt\.reduce\".*?\}\) : \(tensor<[^)]*>\) -> i32", body, re.S), \
            f"{name}: the spin's state is not a reduction"
        read = re.search(r"tt\.atomic_rmw add, acquire, sys, .* : \(tensor<", after)
        assert read, f"{name}: no acquiring atomic read of the flags after the spin"
        assert re.search(r"\"tt\.reduce\"\(", after[read.end():]), f"{name}: the decision is not a reduction"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_scalar_atomic_reaches_every_thread(target):
    """What the waits rely on: the scalar atomic runs in one thread (predicated or branched), and its
    result goes through shared memory behind a CTA barrier before anyone branches on it."""
    llir = _compiled("chunked_wait", target).asm["llir"].splitlines()
    acquire = next(i for i, line in enumerate(llir)
                   if "sys.acquire" in line or ("atomicrmw" in line and "acquire" in line))
    window = "\n".join(llir[acquire:acquire + 12])
    assert re.search(r"st\.shared|store .*addrspace\(3\)", window), window
    assert re.search(r"barrier", window), window
    assert re.search(r"load .*addrspace\(3\)|ld\.shared", window), window


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", LAMPORT)
def test_a_data_wait_spins_on_one_value_for_all_threads(name, target):
    """The all-reduces spin on the data itself (volatile tensor loads of the receive tile), and the
    spin's condition is a scalar that comes out of a reduction over the whole tile, which every
    thread receives; so all threads run the same number of polls, and the barriers in the loop
    (the reduction's) and in the branches after it are met by all of them."""
    loops = list(_spin_loops(_compiled(name, target).asm["ttgir"]))
    assert loops, f"{name}: no spin loop found"
    for loop, _ in loops:
        head = loop.split("} do {", 1)[0]
        assert re.search(r"scf\.while \(.*\) : \(tensor<[^)]*, i32\)", head), f"{name}: the spin state is not a scalar"
        body = loop.split("} do {", 1)[1]
        # a volatile tensor load, or on CDNA a buffer load (which Triton makes of it) that keeps
        # the coherent cache modifier
        assert (re.search(r"tt\.load .*isVolatile = true.* : tensor<", body)
                or re.search(r"amdg\.buffer_load .*cache_?[mM]odifier = cv.*tensor<", body)), \
            f"{name}: no volatile tile load in the spin"
        assert re.search(r"\"tt\.reduce\".*?\}\) : \(tensor<[^)]*>\) -> i32", body, re.S), \
            f"{name}: the spin state is not a reduction"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", LAMPORT)
def test_peer_traffic_moves_in_16_byte_vectors(name, target):
    """Pushes into peers' heaps and the polls of the receive slots are 16-byte vectors: the
    translated peer address keeps its alignment (rma.translate). On CDNA the pushes write through
    and the polls are system-coherent (sc0 sc1), buffer loads included."""
    asm = _compiled(name, target).asm
    if target == "sm90":
        ptx = asm["ptx"]
        assert "st.global.v4.b32" in ptx, f"{name}: no 16-byte stores"
        assert "ld.volatile.global.v4.b32" in ptx, f"{name}: the receive polls are not 16-byte loads"
        assert not re.search(r"st\.global(\.\w+)*\.b16", ptx), f"{name}: 2-byte stores"
    else:
        gcn = asm["amdgcn"]
        assert re.search(r"global_store_dwordx4 .*sc0 sc1", gcn), f"{name}: no 16-byte write-through pushes"
        polls = _polls(gcn)
        assert polls and all("sc0 sc1" in p for p in polls), f"{name}: polls that are not 16-byte and coherent"
        incoherent_buffer_loads = [p for p in polls if p.startswith("buffer") and "sc0 sc1" not in p]
        assert not incoherent_buffer_loads, f"{name}: buffer loads without sc0 sc1 (a poll that may never see a push)"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
def test_the_fused_norm_waits_for_the_kernel_ahead_before_it_reads_its_input():
    """Launched with programmatic dependent launch on Hopper, the fused all-reduce + norm may start while the
    matmul ahead of it runs: its griddepcontrol.wait comes before any load of its input or push to a peer,
    and it lets the kernel behind start only after that wait (triton_compat.release_dependents)."""
    ptx = _compiled("all_reduce_rmsnorm_bf16_w2", "sm90").asm["ptx"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < release, "no griddepcontrol.wait before launch_dependents"
    # before it: only the norm's weight (no kernel writes it); the row, the epochs and every store come after
    assert _memory_sources(ptx[:wait]) <= {("ld", "w_ptr")}, _memory_sources(ptx[:wait])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
def test_the_gemv_reads_weights_before_its_wait_and_x_after():
    """With dependent launch the GEMV may run beside the kernel ahead of it: before its griddepcontrol.wait it
    loads weights only (no kernel writes them); x, which the kernel ahead writes, and every store come after."""
    ptx = _compiled("gemv_pdl", "sm90").asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 < wait < ptx.find("griddepcontrol.launch_dependents"), "no wait before the release"
    before = ptx[:wait]
    loads = re.findall(r"ld\.global[\w.]*", before)
    # the weight tile, 16 x 256 bf16 over 128 threads: 16-byte vectors; x's one row of 256 (M == 1) is read
    # in narrower loads, all after the wait, and so are the pipelined loop's copies and every store
    assert loads and all(ld.endswith(".v4.b32") for ld in loads), f"before the wait: {sorted(set(loads))}"
    assert not re.search(r"st\.global|cp\.async", before), "a store or a copy before the wait"
    assert "griddepcontrol" not in _compiled("gemv", "sm90").asm["ptx"]


def _memory_sources(ptx: str) -> set[tuple[str, str]]:
    """("ld" or "st", the kernel argument its source line names) for each global load and store in `ptx`,
    by the source line of the nearest `.loc` before it (the line's first *_ptr name, else the line)."""
    out, line = set(), ""
    for text in ptx.splitlines():
        loc = re.search(r"//\s*(\w+\.py):(\d+)", text)
        if loc and ".loc" in text:
            src = (ROOT / "kernels" / loc.group(1))
            line = src.read_text().splitlines()[int(loc.group(2)) - 1] if src.exists() else loc.group(0)
        elif re.search(r"\b(ld|st)\.global", text):
            name = re.search(r"\b(\w+_ptr)\b", line)
            out.add(("st" if "st.global" in text else "ld", name.group(1) if name else line.strip()))
    return out


def _polls(gcn: str) -> list[str]:
    """The 16-byte loads of CDNA code that the receive polls emit: those whose source line (the nearest
    `.loc` before them) is in kernels/lamport.py, where every poll is. A kernel's other loads (its own
    input, read before it pushes) may be buffer loads without the coherence bits."""
    polls, source = [], ""
    for line in gcn.splitlines():
        loc = re.search(r";\s*(\w+\.py):\d+", line)
        if loc and ".loc" in line:
            source = loc.group(1)
        elif re.search(r"(?:global|buffer)_load_dwordx4 ", line) and source == "lamport.py":
            polls.append(line.strip())
    return polls


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_wait_clock_reads_the_device_timer(target):
    """clock_ns is %globaltimer on NVIDIA (ns) and s_memrealtime on CDNA (100 MHz), and every wait
    reads it (the bound is time, not polls)."""
    asm = _compiled("clock", target).asm
    if target == "sm90":
        assert "%globaltimer" in asm["ptx"]
    else:
        assert "s_memrealtime" in asm["amdgcn"]
    for name in ("barrier", "one_shot_all_reduce_bf16_w2"):
        code = _compiled(name, target).asm["ptx" if target == "sm90" else "amdgcn"]
        assert ("%globaltimer" if target == "sm90" else "s_memrealtime") in code, name


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_ag_gemm_pushes_16_byte_vectors_then_releases(target):
    """AG-GEMM's pushers move my shard into the peers' heaps in 16-byte vectors (the translated
    peer address keeps its alignment), each piece followed by a releasing system-scope add."""
    asm = _compiled("ag_gemm", target).asm
    if target == "sm90":
        ptx = asm["ptx"]
        assert "st.global.v4.b32" in ptx, "no 16-byte stores"
        # a reduction where the result is unused (red): the pusher does not wait for its round trip
        assert re.search(r"(atom|red)\.global\.(sys\.release|release\.sys)\.add", ptx), "no releasing sys add"
    else:
        assert "global_store_dwordx4" in asm["amdgcn"], "no 16-byte stores"


@pytest.mark.parametrize("name", ["chunked_signal", "chunked_signal_w8", "barrier"])
def test_signals_to_every_peer_are_one_releasing_atomic_at_any_world_size(name):
    """A signal to every peer (and the barrier's to every rank) is one predicated atomic instruction that
    each thread issues for its own rank, not a loop of W - 1 releases each waiting for the last one's
    round trip: a cost that grew with W."""
    ptx = _compiled(name, "sm90").asm["ptx"]
    releases = [line for line in ptx.splitlines() if "atom" in line and ".release" in line and ".sys" in line]
    assert len(releases) == 1, releases  # an unrolled loop over the ranks (static_range) would show W - 1 or W

