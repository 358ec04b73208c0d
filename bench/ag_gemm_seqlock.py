"""What AG-GEMM's seqlock costs (issue 25): the kernel before (BEFORE_REF's kernels/ag_gemm.py, loaded from
git) and after (the package's: one acq_rel system-scope atomic on the begin words per program that read peer
rows, after its tile loops), and the copy engine's push chain per peer before (rows, write-value, flag) and
after (begin word, write-value, rows, write-value, flag).

One GPU, one process, no peer: WORLD=2 with both heaps at one address and the peer's flag already
past every call number, so every wait passes at once and the kernels do exactly the work (and the
checks) of a world-2 call without a peer's timing in it. The push chains copy into this GPU's own
memory on a side stream. Both sides replay from CUDA graphs, interleaved in rounds.

    python bench/ag_gemm_seqlock.py [--out bench/results]     # one GPU, ~1 minute
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, capture_graph, environment, md_table, publish  # noqa: E402

from tp_overlap_plugin.tuning.timing import interleaved_rounds  # noqa: E402

BEFORE_REF = "0ea8ea7"  # main before the seqlock
WORLD = 2
K, N = 4096, 6144                        # Llama-3-8B's QKV projection, whole (TP=1-equivalent columns)
ROWS = [1, 8, 64, 512, 2048]             # rows per shard: decode (1-64) and prefill (512, 2048)


def _kernel_before():
    """ag_gemm_kernel as it was at BEFORE_REF, from its source in git (as a module of its own)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("AG_GEMM_BEFORE"):  # a copy of that file, where the tree has no git (a device machine)
        src = open(os.environ["AG_GEMM_BEFORE"]).read()
    else:
        src = subprocess.run(["git", "-C", root, "show", f"{BEFORE_REF}:kernels/ag_gemm.py"], check=True,
                             capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="ag_gemm_before_"), "ag_gemm_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("ag_gemm_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ag_gemm_kernel


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    from tp_overlap_plugin.stream_write import stream_write_value32
    from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
    from tp_overlap_plugin.kernels.lamport import peers_pow2
    from tp_overlap_plugin.overlap import _fused_config, num_programs

    before = _kernel_before()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dtype = torch.bfloat16
    heap = torch.zeros(1 << 20, dtype=torch.int64, device=dev)  # 256-byte aligned words
    heap_bases = torch.tensor([heap.data_ptr()] * WORLD, dtype=torch.int64, device=dev)
    error = heap[:8]
    error[7] = int(60e9)                                          # the wait bound, ns
    flags = heap[64:64 + WORLD - 1]
    flags.fill_(1 << 62)                                          # every call's rows "arrived"
    begin = heap[128:128 + WORLD - 1]                             # stays 0: no later writer
    rows_out, payload = [], {"world": WORLD, "K": K, "N": N, "before": BEFORE_REF, "kernel": [], "push": []}
    programs = num_programs(dev)
    for rows in ROWS:
        cfg = _fused_config(rows, N, K, dev, None)
        a = torch.randn(rows, K, dtype=dtype, device=dev)
        gathered = torch.randn(WORLD - 1, rows, K, dtype=dtype, device=dev)
        b = torch.randn(N, K, dtype=dtype, device=dev).t()      # an nn.Linear weight, as the layers pass it
        c = torch.empty(WORLD * rows, N, dtype=dtype, device=dev)
        calls = {"before": torch.zeros(2, dtype=torch.int64, device=dev),
                 "after": torch.zeros(2, dtype=torch.int64, device=dev)}
        common = dict(a_ptr=a, b_ptr=b, c_ptr=c, gathered_ptr=gathered, rows=rows, N=N, K=K, stride_bk=b.stride(0),
                      stride_bn=b.stride(1), slot_stride=rows * K, flags_ptr=flags, rank=0, heap_bases=heap_bases,
                      error_ptr=error, WORLD=WORLD, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, EVEN_K=K % cfg.block_k == 0, INTERPRET=False, FLATTEN=cfg.flatten,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        launches = {
            "before": lambda: before[(programs,)](calls_ptr=calls["before"], **common),
            "after": lambda: ag_gemm_kernel[(programs,)](calls_ptr=calls["after"], begin_ptr=begin,
                                                         PEERS_POW2=peers_pow2(WORLD), **common),
        }
        ref = torch.cat([a, gathered[0]]).float() @ b.float()
        for name, fn in launches.items():
            c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, rows, err)
        assert int(error[0]) == 0, "a wait gave up or a begin word moved"
        calls_per_replay = 20
        replays = {name: capture_graph(fn, calls_per_replay) for name, fn in launches.items()}
        times = interleaved_rounds(replays, calls=calls_per_replay, rounds=args.rounds, samples=5)
        us = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
        ratios = sorted(a_ / b_ for a_, b_ in zip(times["after"], times["before"]))
        payload["kernel"].append({"rows": rows, "M": WORLD * rows, "config": str(cfg), "us": us, "rounds_ms": times})
        rows_out.append([f"kernel, {rows} rows/shard (M={WORLD * rows})", us["before"], us["after"],
                         us["after"] / us["before"], f"{ratios[0]:.3f}-{ratios[-1]:.3f}"])

    # the copy engine's chain into one peer, on a side stream
    side = torch.cuda.Stream(dev)
    fence = torch.zeros(1, dtype=torch.int32, device=dev)
    push_value = torch.ones(2, dtype=torch.int64, device=dev)
    for rows in (1, 64, 2048):
        src = torch.randn(rows, K, dtype=dtype, device=dev)
        dst = torch.empty(rows, K, dtype=dtype, device=dev)
        flag, word = heap[192:193], heap[200:201]

        def old_chain():
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                stream_write_value32(fence, 1)
                flag.copy_(push_value[:1], non_blocking=True)

        def new_chain():
            with torch.cuda.stream(side):
                word.copy_(push_value[1:], non_blocking=True)
                stream_write_value32(fence, 1)
                dst.copy_(src, non_blocking=True)
                stream_write_value32(fence, 1)
                flag.copy_(push_value[:1], non_blocking=True)

        def chained(fn):
            def run():
                side.wait_stream(torch.cuda.current_stream())
                fn()
                torch.cuda.current_stream().wait_stream(side)
            return run

        replays = {"before": capture_graph(chained(old_chain), 10), "after": capture_graph(chained(new_chain), 10)}
        times = interleaved_rounds(replays, calls=10, rounds=args.rounds, samples=5)
        us = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
        ratios = sorted(a_ / b_ for a_, b_ in zip(times["after"], times["before"]))
        payload["push"].append({"rows": rows, "us": us, "rounds_ms": times})
        rows_out.append([f"push chain, {rows} rows", us["before"], us["after"], us["after"] / us["before"],
                         f"{ratios[0]:.3f}-{ratios[-1]:.3f}"])
    payload["environment"] = environment(1)
    md = ("AG-GEMM before/after the seqlock, world 2 with the waits passing at once, one GPU, CUDA-graph "
          f"replays, median of {args.rounds} interleaved rounds (K={K}, N={N}, bf16)\n\n"
          + md_table(["what", "before us", "after us", "after/before", "per-round ratio range"], rows_out))
    publish(args.out, "ag-gemm-seqlock-ab", payload, md)


if __name__ == "__main__":
    main()
