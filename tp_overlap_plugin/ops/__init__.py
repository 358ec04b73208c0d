"""The host ops, one module per op (kernels/ has the kernel of each under the same name):

    gemm.py             gemm, gemm_silu_mul: the GEMM core (every matmul below runs its tiles)
    gemv.py             gemv, gemv_silu_mul: the decode matmul, 1..64 rows (gate_up with its activation, 1..16)
    ag_gemm.py          AllGatherGemm: all_gather(a) @ b, the gather pushed from inside the GEMM
    gemm_rs.py          GemmReduceScatter: reduce_scatter(a @ b), partials stored into their owners
    gemm_ar.py          GemmAllReduce: all_reduce(x @ w.T) for decode rows, pushed from the epilogue
    all_reduce.py       HeapAllReduce: one-shot / two-shot
    all_reduce_norm.py  HeapAllReduceNorm: all-reduce + residual add + RMSNorm
    chunked.py          ChunkedAllGatherGemm, ChunkedGemmReduceScatter: AG-GEMM / GEMM-RS as the vendor's
                        GEMM per peer's block and copy-engine pulls (several launches a call)
and what they share: device.py (grid sizes, warp width), slots.py (receive slots; PeerSlotOp, what
AG-GEMM and GEMM-RS hold alike), operands.py (operand checks). Each op but the chunked ones is one
launch whatever the world size; each keeps its per-call
state in device memory (CUDA-graph capturable) and falls back to the stock op for what its kernel
does not take; `stats` records which path ran.

Nothing is imported here: importing an op loads Triton and its kernel, which a process that only
reads a table must not pay.
"""
