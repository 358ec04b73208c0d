"""The one GEMM core: `tile_coords`, `gemm_tile` and `store_tile`. Every matmul in this package is
made of them: the plain GEMM `gemm_kernel` (a persistent loop over output tiles), and the fused ops,
which drive the same tiles from a work queue and add their communication around them: AG-GEMM
waits for a peer's row block before its tiles (kernels/ag_gemm.py), GEMM-RS stores tiles straight
into a peer's heap and reduces its own (kernels/gemm_rs.py), GEMM + all-reduce pushes every tile
into every peer's heap and sums what lands (kernels/gemm_ar.py). Nothing else multiplies matrices.

Two ways to read the operands, one body (constexpr `TMA`):
- TMA: `a_ptr`/`b_ptr` are tensor descriptors, so on Hopper the loads are bulk tensor copies the
  compiler can pipeline and, with `WARP_SPEC`, hand to a producer warp group. Out-of-range rows,
  columns and K are zero-filled by the copy itself. The host builds them
  (triton.tools.tensor_descriptor) unless `DEVICE_DESC`: then the kernel builds them from the
  pointers and strides, which costs each program a descriptor write and a global scratch buffer
  from the host, but is what Hopper's warp specialization can repartition (it splits the A tile
  between consumer groups, and a host descriptor's block shape is fixed). B as the transpose of an
  nn.Linear weight (`B_KMAJOR`) is described as the weight, [N, K], and transposed in registers.
- Pointers (interpreter, unaligned operands, targets without descriptors): rows are taken modulo
  the valid row count and columns modulo N, so the K loop needs no row/column masks (duplicated
  rows are computed and never stored); only a ragged K is masked (`EVEN_K` drops it). Offsets
  are int64 (`operand_pointers`, and the stores).

C is always addressable by pointer (GEMM-RS stores into a peer's heap that way); `C_TMA` stores
through a descriptor `c_desc` instead. `SUBTILE` stores the tile in two column halves, which halves
the staging buffer the store needs (shared memory that can go to a pipeline stage instead).

Split-K (`SPLIT`, for few tiles and long K): work item = (tile, k-slice). Each slice writes its
fp32 partial to a workspace; the slice that finishes last (a per-tile counter) sums all partials in
slice order and stores C, then zeroes the counter for the next launch. One launch, no host state,
deterministic, capturable in a CUDA graph.

`SILU_MUL` (gate_up_proj's epilogue): B holds gate and up side by side, 2N columns, and C [M, N]
is silu(gate) * up. A program's tile of C reads the gate block and the up block of its columns
against each A block (two accumulators; the host gives it half the table's BLOCK_N, so the two
B blocks are the plain GEMM's one in shared memory and registers), so neither the weight layout
nor its loading changes, and the [M, 2N] product is never written.

`INTERPRET` is set when the kernel runs under the Triton interpreter (CPU tests): its tl.dot
multiplies bf16 operands as raw 16-bit integers, so there the operands are widened to fp32 first.
"""

import triton
import triton.language as tl

# Defaults of constexpr parameters must be constexpr objects (Triton 3.6 passes a plain str through).
_NO_CACHE = tl.constexpr("")
_PLAIN = tl.constexpr(False)

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
def operand_pointers(a_ptr, b_ptr, pid_m, pid_n, M, N, k0, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers to tile (pid_m, pid_n)'s first K block of A (rows taken modulo M) and of B (columns
    modulo N), from K index k0. Offsets are int64: a row index times a row stride passes 2^31 as
    soon as an operand has 2^31 elements (a 16384-token step against a 152k vocabulary), and int32
    products would wrap to a wrong or illegal address."""
    rows = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
    cols = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    return a_ptrs, b_ptrs


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _b_block(b_ptr, k, col0, BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr):
    """B's [BLOCK_K, BLOCK_N] block at K block k and column col0, through its descriptor."""
    if B_KMAJOR:  # the descriptor is over B^T (an nn.Linear weight, [N, K])
        b = b_ptr.load([col0, k * BLOCK_K]).T
    else:
        b = b_ptr.load([k * BLOCK_K, col0])
    return b


@triton.jit
def gemm_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              INTERPRET: tl.constexpr, TMA: tl.constexpr = False, B_KMAJOR: tl.constexpr = False,
              SILU_MUL: tl.constexpr = _PLAIN):
    """fp32 accumulator of A[tile rows, K blocks k_lo..k_hi) @ B[same K, tile cols].

    SILU_MUL: B is gate | up side by side, 2N columns (gate_up_proj's weight as it is loaded), and
    the tile is silu(A @ B[:, cols]) * (A @ B[:, N + cols]): two accumulators, each A block against
    the gate block and the up block of the same columns, so C is [M, N] and the [M, 2N] product
    never reaches memory. The activation is applied to the fp32 sums (one rounding, at the store),
    so a tile cannot be a partial sum: no split-K with it."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        for k in range(k_lo, k_hi):
            a = a_ptr.load([row0, k * BLOCK_K])
            acc = _mma(a, _b_block(b_ptr, k, col0, BLOCK_K, B_KMAJOR), acc, INTERPRET)
            if SILU_MUL:  # gate columns past N read up's first ones: computed, never stored
                up = _mma(a, _b_block(b_ptr, k, N + col0, BLOCK_K, B_KMAJOR), up, INTERPRET)
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs, b_ptrs = operand_pointers(a_ptr, b_ptr, pid_m, pid_n, M, N, k_lo * BLOCK_K, stride_am, stride_ak,
                                          stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        if SILU_MUL:
            b_up_ptrs = b_ptrs + tl.full((1, BLOCK_N), N, tl.int64) * stride_bn
        for k in range(k_lo, k_hi):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                if SILU_MUL:
                    b_up = tl.load(b_up_ptrs)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
                if SILU_MUL:
                    b_up = tl.load(b_up_ptrs, mask=ks[:, None] < k_left, other=0.0)
            acc = _mma(a, b, acc, INTERPRET)
            if SILU_MUL:
                up = _mma(a, b_up, up, INTERPRET)
                b_up_ptrs += BLOCK_K * stride_bk
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    return acc


@triton.jit
def _store_part(c_ptr, c_desc, part, pid_m, col0, M, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, C_TMA: tl.constexpr, CACHE: tl.constexpr = _NO_CACHE):
    if C_TMA:
        c_desc.store([pid_m * BLOCK_M, col0], part.to(c_ptr.dtype.element_ty))
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, WIDTH)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn,
                 part.to(c_ptr.dtype.element_ty), mask=mask, cache_modifier=CACHE)


@triton.jit
def store_tile(c_ptr, c_desc, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_TMA: tl.constexpr = False, SUBTILE: tl.constexpr = False,
               CACHE: tl.constexpr = _NO_CACHE):
    """Rows >= M and columns >= N of the tile are not stored. CACHE: the store's cache modifier
    (".wt" for a push into a peer's heap on CDNA, which a reader polls: kernels/all_reduce.py)."""
    col0 = pid_n * BLOCK_N
    if SUBTILE:
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        _store_part(c_ptr, c_desc, left, pid_m, col0, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N // 2, C_TMA, CACHE)
        _store_part(c_ptr, c_desc, right, pid_m, col0 + BLOCK_N // 2, M, N, stride_cm, stride_cn, BLOCK_M,
                    BLOCK_N // 2, C_TMA, CACHE)
    else:
        _store_part(c_ptr, c_desc, acc, pid_m, col0, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, C_TMA, CACHE)


@triton.jit
def device_descriptors(a_ptr, b_ptr, c_ptr, c_desc, M, N, K, stride_am, stride_bk, stride_bn, stride_cm,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr,
                       C_TMA: tl.constexpr, SUBTILE: tl.constexpr, SILU_MUL: tl.constexpr = _PLAIN):
    """The descriptors the host would have built; it checked the alignment they need."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_cols = 2 * N if SILU_MUL else N  # gate | up
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[b_cols, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, b_cols], strides=[stride_bk, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    if C_TMA:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2 if SUBTILE else BLOCK_N])
    return a_desc, b_desc, c_desc


@triton.jit
def gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                c_desc, split_ws_ptr, split_count_ptr, split_k,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, FLATTEN: tl.constexpr,
                TMA: tl.constexpr, B_KMAJOR: tl.constexpr, C_TMA: tl.constexpr, SUBTILE: tl.constexpr,
                WARP_SPEC: tl.constexpr, SPLIT: tl.constexpr, DEVICE_DESC: tl.constexpr,
                SILU_MUL: tl.constexpr = _PLAIN):
    """C = A @ B, persistent: program p takes work items p, p + P, p + 2P, ... With SILU_MUL,
    C [M, N] = silu(A @ B[:, :N]) * (A @ B[:, N:]) (gemm_tile): N is C's width, B's is 2N.

    A static assignment keeps the tile loop a plain loop the compiler can flatten: with FLATTEN the
    tile loop and the K loop become one pipelined loop, so the next tile's first loads are in
    flight during this tile's epilogue. WARP_SPEC instead gives the loads to a producer warp group
    (Hopper: num_warps=4 per consumer group, not flattened). With SPLIT, `split_k` slices of K per
    tile (see the module docstring). The fused ops (ag_gemm.py, gemm_rs.py) drive the same tile
    functions from a work queue instead, because their tiles wait on peers."""
    tl.static_assert(not (SILU_MUL and SPLIT), "the activation needs whole sums: no split-K with SILU_MUL")
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    if DEVICE_DESC:
        a_ptr, b_ptr, c_desc = device_descriptors(a_ptr, b_ptr, c_ptr, c_desc, M, N, K, stride_am, stride_bk, stride_bn,
                                                  stride_cm, BLOCK_M, BLOCK_N, BLOCK_K, B_KMAJOR, C_TMA, SUBTILE,
                                                  SILU_MUL)
    k_blocks = tl.cdiv(K, BLOCK_K)
    if SPLIT:
        slices = split_k
    else:
        slices = 1
    k_per = tl.cdiv(k_blocks, slices)
    for item in tl.range(tl.program_id(0), tiles * slices, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPEC):
        tile = item // slices
        pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        k_lo = (item % slices) * k_per
        k_hi = tl.minimum(k_lo + k_per, k_blocks)
        acc = gemm_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, K, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, TMA=TMA, B_KMAJOR=B_KMAJOR, SILU_MUL=SILU_MUL)
        if SPLIT:
            cells = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tile_ws = split_ws_ptr + tile.to(tl.int64) * slices * BLOCK_M * BLOCK_N
            tl.store(tile_ws + (item % slices) * BLOCK_M * BLOCK_N + cells, acc)
            # every thread's partial is written before the one thread that counts releases them
            tl.debug_barrier()
            arrived = tl.atomic_add(split_count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == slices - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(slices):  # slice order, whoever came last: the sum is deterministic
                    total += tl.load(tile_ws + s * BLOCK_M * BLOCK_N + cells, cache_modifier=".cg")
                tl.atomic_xchg(split_count_ptr + tile, 0, sem="relaxed", scope="gpu")
                store_tile(c_ptr, c_desc, total, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                           C_TMA=C_TMA, SUBTILE=SUBTILE)
        else:
            store_tile(c_ptr, c_desc, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, C_TMA=C_TMA,
                       SUBTILE=SUBTILE)
