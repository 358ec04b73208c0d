"""The one GEMM core. Every matmul in this package (plain, all-gather + GEMM, GEMM + reduce-scatter)
is `gemm_kernel`: a persistent loop over output tiles that calls `tile_coords` and `gemm_tile`. The
fused ops add their communication around it: a prologue that waits for a peer's A rows (AG-GEMM),
and C written straight into a peer's heap (GEMM-RS). Nothing else multiplies matrices.

`INTERPRET` is set when the kernel runs under the Triton interpreter (CPU tests): its tl.dot
multiplies bf16 operands as raw 16-bit integers, so there the operands are widened to fp32 first.

Rows are taken modulo the valid row count and columns modulo N, so the K loop needs no row/column
masks (the duplicated rows are computed and never stored); only a ragged K is masked.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma


@triton.jit
def tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each B column panel while it is in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def gemm_tile(a_ptr, b_ptr, rows, cols, K, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              INTERPRET: tl.constexpr):
    """fp32 accumulator of A[rows, :] @ B[:, cols]; rows/cols must already be in bounds."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        if INTERPRET:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["wait_value"])
def gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                wait_ptr, wait_count, wait_value, rank, peer, heap_bases, error_ptr, max_spins,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, FLATTEN: tl.constexpr, WAIT: tl.constexpr):
    """C = A @ B, persistent: program p takes tiles p, p + P, p + 2P, ...

    Prologue (WAIT): first wait until `wait_count` flags from `peer` reach `wait_value` (A's rows
    are arriving from that peer). Waiting once, before the tile loop, keeps the loop a plain loop
    the compiler can flatten: with FLATTEN the tile loop and the K loop become one pipelined loop,
    so the next tile's first loads are in flight during this tile's epilogue. C may be a peer's
    memory (GEMM-RS stores its partials straight into the owner's heap).

    With WAIT the program computes no tile once this rank has given up on a peer (its error slot
    is set, or a wait here fails): A may be stale, and C in a peer's heap may still be read by
    that peer. wait_count = 0 keeps only that check."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    if WAIT:
        ok = rma.no_error(error_ptr)
        for i in range(wait_count):
            ok = ok & rma.signal_wait(wait_ptr + i, wait_value, rank, peer, heap_bases, error_ptr, max_spins)
        if not ok:
            tiles = 0
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = gemm_tile(a_ptr, b_ptr, rows % M, cols % N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask)
