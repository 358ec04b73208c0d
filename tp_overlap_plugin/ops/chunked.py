"""The chunked fused ops: AG-GEMM and GEMM-RS whose GEMMs are the vendor library's (torch.mm: cuBLAS,
hipBLASLt), one per chunk on the caller's stream, while a push kernel on a side stream moves the
chunks between heaps on a few programs (kernels/vendor_comm.py says why and how the buffers work).

`ChunkedAllGatherGemm`: c = all_gather(a_shard) @ b. The pushers send my shard to every peer at
once, chunk by chunk of rows; meanwhile the vendor GEMM multiplies my own rows; then, chunk by
chunk, one wait for the chunk's rows from every peer and one GEMM per peer on them.

`ChunkedGemmReduceScatter`: c_shard = reduce_scatter(a @ b). The product is computed in chunks of
columns, each a vendor GEMM over all M rows; after each, the pushers send every peer its rows of
that chunk while the next chunk computes; the last kernel waits for the peers' partials and sums
all W in rank order (fp32), so every rank rounds alike.

Both keep their state in device memory (call number, counts, free words): calls can be captured in
CUDA graphs. A case they do not take goes to the sequential op (stock collective + matmul), as the
one-launch ops do. Host work per call: a few launches, independent of W except AG's per-peer GEMMs
(W - 1 per chunk; bench/notes/prefill.md weighs that at W = 8)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.vendor_comm import (push_rows_kernel, reduce_rows_kernel, signal_free_kernel,
                                                   wait_rows_kernel)
from tp_overlap_plugin.ops.device import resident_programs
from tp_overlap_plugin.ops.operands import check_operands, kernel_applies
from tp_overlap_plugin.ops.slots import round_up

PIECE_BYTES = 256 << 10     # a pusher's unit before its releasing add (as ops/ag_gemm.py's pieces)
PUSH_STEP_ELEMS = 16384     # elements one push step moves
PUSHERS_PER_PEER = 8        # programs that fill the links to one peer (bench/results/remote-bw-tp2-*)
CHUNKS = 2                  # row chunks (AG) or column chunks (RS) per call
REDUCE_TILE = (32, 128)     # RS's reduction tile: rows, columns


def _pushers(world: int, device: torch.device) -> int:
    return max(1, min(PUSHERS_PER_PEER * (world - 1), resident_programs(device) // 4))


def _piece(row_bytes: int, cols: int) -> tuple[int, int]:
    """(rows per piece, a power of two; columns per push step, a power of two)."""
    piece_rows = 1 << max(0, (PIECE_BYTES // max(row_bytes, 1)).bit_length() - 1)
    return piece_rows, min(triton.next_power_of_2(max(cols, 1)), max(16, PUSH_STEP_ELEMS // piece_rows))


class _ChunkedOp:
    """What both ops share: receive slots [W - 1, max_rows, cols], their counts [W - 1, chunks], the
    free words [W - 1] in the heap; the call counter; the side stream the pushes run on."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, cols: int, dtype: torch.dtype, device_group, chunks: int,
                 name: str, pushers: int | None = None):
        if max_rows < 1 or cols < 1 or chunks < 1:
            raise ValueError(f"{type(self).__name__} needs max_rows, cols, chunks >= 1; got {max_rows}, {cols}, {chunks}")
        self.heap, self.max_rows, self.cols, self.dtype, self.chunks = heap, max_rows, cols, dtype, chunks
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        peers = max(heap.world_size - 1, 1)
        self.slots = heap.alloc((peers, max_rows, cols), dtype, name=f"{name}.slots")
        self.counts = heap.alloc((peers, chunks), torch.int64, name=f"{name}.counts")
        self.free = heap.alloc((peers,), torch.int64, name=f"{name}.free")
        self.counts.zero_()
        self.free.zero_()
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.side = torch.cuda.Stream(heap.device) if heap.device.type == "cuda" else None
        self.stream_order = runtime.StreamOrder()
        self.pushers = pushers or _pushers(heap.world_size, heap.device)
        # Triton's own launch path (kernel[grid]), not launch.Launcher's direct one: with Launchers the
        # engine's first chunked step on H200x4 ended in a wait that gave up, while the ops alone
        # passed (bench/notes/prefill.md, section 4: not explained yet)
        self._comm = dict(rank=heap.rank, heap_bases=heap.heap_bases, error_ptr=heap.error, WORLD=heap.world_size,
                          SEGMENTS=chunks)
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, max_rows: int, cols: int, dtype: torch.dtype, chunks: int = CHUNKS) -> int:
        peers = max(world - 1, 1)
        es = torch.empty((), dtype=dtype).element_size()
        return round_up(peers * max_rows * cols * es, 256) + round_up(peers * chunks * 8, 256) + round_up(peers * 8, 256)

    def _push(self, src, rows, src_stride, src_peer_stride, cols, col0, seg, seg_rows, piece_rows, push_cols) -> None:
        """The push kernel on the side stream, after everything the caller's stream has queued."""
        def launch():
            push_rows_kernel[(self.pushers,)](
                src, self.slots, self.counts, self.free, self.calls, rows, src_stride, src_peer_stride, cols, col0,
                self.cols, self.max_rows * self.cols, seg, seg_rows, PIECE_ROWS=piece_rows, PUSH_COLS=push_cols,
                **self._comm)
        if self.side is None:
            launch()
            return
        self.side.wait_stream(torch.cuda.current_stream(self.heap.device))
        with torch.cuda.stream(self.side):
            launch()

    def _wait(self, row0: int, rows: int, pieces: int, seg_lo: int, seg_hi: int) -> None:
        """One program waits for chunks seg_lo..seg_hi-1 from every peer (kernels/vendor_comm.py)."""
        wait_rows_kernel[(1,)](self.slots, self.counts, row0=row0, rows=rows, cols=self.cols,
                               slot_stride=self.max_rows * self.cols, pieces=pieces, seg_lo=seg_lo, seg_hi=seg_hi,
                               BLOCK=1024, **self._comm)

    def _join(self) -> None:
        """The caller's stream waits for the pushes: they read its tensors, and a graph capture must
        end on the stream it began on."""
        if self.side is not None:
            torch.cuda.current_stream(self.heap.device).wait_stream(self.side)


class ChunkedAllGatherGemm(_ChunkedOp):
    """c = all_gather(a_shard) @ b with the vendor GEMM per chunk; capacity `max_rows` rows per
    shard of `k` columns, fixed at construction (the heap is symmetric)."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, chunks: int = CHUNKS, pushers: int | None = None):
        super().__init__(heap, max_rows, k, dtype, device_group, chunks, "chunked_ag", pushers)


    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = self.heap
        check_operands("chunked ag_gemm", a_shard, b, h.device)
        rows, k = a_shard.shape
        n, W, me = b.shape[1], h.world_size, h.rank
        if (rows == 0 or n == 0 or W == 1 or rows > self.max_rows or k != self.cols or a_shard.dtype != self.dtype
                or not kernel_applies(a_shard)):
            stats.record("chunked_ag.fallback")
            return runtime.all_gather(a_shard, self.device_group) @ b
        self.stream_order.before_call(h.device)
        stats.record("chunked_ag.kernel")
        piece_rows, push_cols = _piece(k * a_shard.element_size(), k)
        seg_rows = round_up(-(-rows // self.chunks), piece_rows)
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        self._push(a_shard, rows, k, 0, k, 0, -1, seg_rows, piece_rows, push_cols)
        torch.mm(a_shard, b, out=c[me * rows:(me + 1) * rows])
        for s, r0 in enumerate(range(0, rows, seg_rows)):
            r1 = min(rows, r0 + seg_rows)
            self._wait(r0, r1 - r0, -(-(r1 - r0) // piece_rows), s, s + 1)
            for j in range(W - 1):
                src = (me + 1 + j) % W
                torch.mm(self.slots[j, r0:r1], b, out=c[src * rows + r0:src * rows + r1])
        signal_free_kernel[(1,)](self.counts, self.free, self.calls, me, h.heap_bases, WORLD=W, SEGMENTS=self.chunks)
        self._join()
        h.check_if_free()
        return c


class ChunkedGemmReduceScatter(_ChunkedOp):
    """c_shard = reduce_scatter(a @ b) with the vendor GEMM per column chunk: rank r gets rows
    [r * M / W, (r + 1) * M / W) of the sum over ranks. M not divisible by W is padded with zero
    rows (they come back as zeros at the end of the last rank's shard), as GemmReduceScatter does.
    Capacity `max_rows` rows per shard of `n` columns."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, chunks: int = CHUNKS, pushers: int | None = None):
        super().__init__(heap, max_rows, n, dtype, device_group, chunks, "chunked_rs", pushers)


    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = self.heap
        check_operands("chunked gemm_rs", a, b, h.device)
        W, me = h.world_size, h.rank
        m, k = a.shape
        n = b.shape[1]
        if m % W:
            a = torch.cat([a, a.new_zeros((W - m % W, k))])
        rows = a.shape[0] // W
        if (rows == 0 or k == 0 or W == 1 or rows > self.max_rows or n != self.cols or a.dtype != self.dtype
                or not kernel_applies(a)):
            stats.record("chunked_rs.fallback")
            return runtime.reduce_scatter(a @ b, self.device_group)
        self.stream_order.before_call(h.device)
        stats.record("chunked_rs.kernel")
        M = W * rows
        # column chunks of a multiple of 64 values: 16-byte aligned rows in every chunk's pushes
        seg_cols = round_up(-(-n // self.chunks), 64)
        partials = torch.empty(M * n, dtype=a.dtype, device=h.device)  # chunk s: [M, width_s] at s * M * seg_cols
        piece_rows, _ = _piece(seg_cols * a.element_size(), seg_cols)
        for s, c0 in enumerate(range(0, n, seg_cols)):
            width = min(seg_cols, n - c0)
            part = partials[s * M * seg_cols:s * M * seg_cols + M * width].view(M, width)
            torch.mm(a, b[:, c0:c0 + width], out=part)
            self._push(part, rows, width, rows * width, width, c0, s, 1, piece_rows,
                       min(triton.next_power_of_2(width), max(16, PUSH_STEP_ELEMS // piece_rows)))
        used, pieces = -(-n // seg_cols), -(-rows // piece_rows)
        # one program waits for the partials; the reduction's grid starts once they are in
        self._wait(0, 0, pieces, 0, used)
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        tiles = -(-rows // REDUCE_TILE[0]) * -(-n // REDUCE_TILE[1])
        reduce_rows_kernel[(min(tiles, resident_programs(h.device)),)](
            partials, M * seg_cols, self.slots, self.counts, self.free, self.calls, c, rows, n, seg_cols,
            self.max_rows * n, pieces, me, h.heap_bases, h.error, used, WORLD=W, SEGMENTS=self.chunks,
            BLOCK_M=REDUCE_TILE[0], BLOCK_N=REDUCE_TILE[1])
        self._join()
        h.check_if_free()
        return c
