"""y[M, N] = x[M, K] @ W[N, K]^T for decode-sized M (1..16): a stream over an nn.Linear weight, on the
CUDA cores. The FMA path of the decode matmul (ops.gemv); its tensor-core path is the GEMM core
with the operands swapped (tp_overlap_plugin/decode_config.py says which runs where).

At one to a few rows the op moves the weight from HBM once and does almost no arithmetic, so what
decides its time is how many weight bytes are in flight, not the tensor cores. The GEMM core
(kernels/gemm.py) pads M to a 16-row MMA tile and takes its loads through the MMA pipeline; cuBLAS
runs a GEMV kernel here that streams these shard shapes at 2.2-3.9 TB/s on an H200 (copy: 4.1-4.3).
This kernel streams the same shapes at 2.7-4.4 TB/s (bench/notes/gemm.md, "GEMV for decode").

Program p owns BLOCK_N consecutive output columns, i.e. BLOCK_N whole rows of W, and walks K.
- Tiles of W and x are 2-D and contiguous along K, so each thread loads 16-byte vectors (8 bf16)
  with the lanes of a warp along K on every Triton version: 4-D pointer tensors leave the order of
  their size-1 dimensions to a tie-break that Triton 3.6 resolves with the lanes along N.
- `tl.range(num_stages=)` on the K loop is what makes the pipeliner stage loads that feed no
  tl.dot (cp.async into a ring in shared memory); the launch's num_stages alone does not.
- x is loaded before W: layout propagation then keeps W's layout at the product and reads x's
  small tile from shared memory into it (the other order converts W's tile: +30% instructions).
- The products of a 16-byte vector are added to a running sum one after the other, not by a
  tree (`_add_vector`): with fp contraction that is 8 FFMA per 8 weights on Triton 3.6 and 3.9.
- The accumulator keeps one partial per vector slot ([M_PAD, BLOCK_N, BLOCK_K / 8]); the reduction
  across the lanes happens once, after the loop.
- Rows of W past N and rows of x past M are clamped, not masked, so the loads carry no mask except
  for the K tail; the extra rows are computed and not stored.
- With programmatic dependent launch (PDL, ops.gemv's `dependent_launch`), the kernel may start while the
  kernel ahead of it still runs (the fused all-reduce + norm lets it, once its own inputs are in): each
  program loads its first weight tile, which no kernel writes, then waits for the kernel ahead
  (triton_compat.wait_for_previous) before it reads x; the first tile's product is peeled off the loop.
  So the weight stream starts while the all-reduce before the matmul waits for its peers.
- `SILU_MUL` (gate_up_proj at decode): W is [2N, K], gate rows then up rows, and y [M, N] is
  silu(x @ gate^T) * (x @ up^T). Program p takes BLOCK_N output columns and streams their gate and up
  rows as one 2 * BLOCK_N-row tile, interleaved (row 2j: gate of column j, 2j + 1: its up), so the
  loop is the plain kernel's, and the pair is split apart after the reduction. The activation is
  applied to the fp32 sums and rounded once, as the GEMM core's SILU_MUL epilogue does: one launch
  instead of the matmul and the SiLU-mul kernel, and the [M, 2N] product is never written.
No split of K: at these shapes the column blocks alone give 192-4000 programs, and a measured
split-K variant (deterministic: the last slice to arrive sums them) gained at most 2% at M <= 4.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import triton_compat

VEC = tl.constexpr(8)  # bf16 elements in a 16-byte load


@triton.jit
def _add_vector(acc, p):
    """acc + p summed over its last axis (one 16-byte vector, 8 values, held by one thread), added
    one value at a time so every product folds into an FMA."""
    a, b = tl.split(tl.reshape(p, [p.shape[0], p.shape[1], p.shape[2], 2, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    p0, p1 = tl.split(a0)
    p2, p3 = tl.split(a1)
    p4, p5 = tl.split(b0)
    p6, p7 = tl.split(b1)
    acc += p0
    acc += p1
    acc += p2
    acc += p3
    acc += p4
    acc += p5
    acc += p6
    acc += p7
    return acc


@triton.jit
def _tile(ptrs, k0, ks, K, EVEN_K: tl.constexpr):
    """The [rows, BLOCK_K] tile at k0 (zeros past K)."""
    if EVEN_K:
        t = tl.load(ptrs + k0)
    else:
        t = tl.load(ptrs + k0, mask=((k0 + ks) < K)[None, :], other=0.0)
    return t


@triton.jit
def _product(xt, wt, M_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's tile times W's, [M_PAD, BLOCK_N, BLOCK_K // VEC, VEC], widened before the product: exact, and
    the interpreter has no bf16 arithmetic."""
    x4 = tl.reshape(xt.to(tl.float32), [M_PAD, 1, BLOCK_K // VEC, VEC])
    w4 = tl.reshape(wt.to(tl.float32), [1, ROWS, BLOCK_K // VEC, VEC])
    return w4 * x4


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
                SILU_MUL: tl.constexpr = False):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.static_assert(not (SILU_MUL and HAS_BIAS), "gemv_kernel: SILU_MUL takes no bias")
    ROWS: tl.constexpr = BLOCK_N * 2 if SILU_MUL else BLOCK_N  # weight rows a program streams
    if SILU_MUL:  # gate and up of each column, side by side (module docstring)
        pair = tl.arange(0, ROWS)
        w_rows = tl.minimum(tl.program_id(0) * BLOCK_N + pair // 2, N - 1) + (pair % 2) * N
    else:
        w_rows = tl.minimum(cols, N - 1)
    x_rows = tl.minimum(tl.arange(0, M_PAD), M - 1)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros([M_PAD, ROWS, BLOCK_K // VEC], dtype=tl.float32)
    first = 0
    if PDL:  # the first weight tile before the wait, x after it (see the module's docstring)
        wt = _tile(w_ptrs, 0, ks, K, EVEN_K)
        triton_compat.wait_for_previous()
        triton_compat.release_dependents()
        acc = _add_vector(acc, _product(_tile(x_ptrs, 0, ks, K, EVEN_K), wt, M_PAD, ROWS, BLOCK_K))
        first = BLOCK_K
    for k0 in tl.range(first, K, BLOCK_K, num_stages=NUM_STAGES):
        xt = _tile(x_ptrs, k0, ks, K, EVEN_K)
        wt = _tile(w_ptrs, k0, ks, K, EVEN_K)
        acc = _add_vector(acc, _product(xt, wt, M_PAD, ROWS, BLOCK_K))
    y = tl.sum(acc, axis=2)
    if SILU_MUL:
        gate, up = tl.split(tl.reshape(y, [M_PAD, BLOCK_N, 2]))
        y = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    rows = tl.arange(0, M_PAD)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
