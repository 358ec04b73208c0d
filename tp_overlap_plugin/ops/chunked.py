"""The chunked fused ops: AG-GEMM and GEMM-RS whose GEMMs are the vendor library's (torch.mm: cuBLAS,
hipBLASLt), one per peer's block of rows on the caller's stream, while the copy engine pulls the
blocks from the peers' heaps on a side stream (kernels/chunked.py says why and how the flags
work). No SM moves data: the GEMMs keep the whole chip.

`ChunkedAllGatherGemm`: c = all_gather(a_shard) @ b. My shard goes into my heap's send slot and I
say "ready"; the GEMM multiplies my own rows while the side stream pulls each peer's shard in turn
(rank me + 1 first; on CDNA, where each peer is a link of its own, a stream per peer pulls them all
at once: ops.device.pull_lanes), and each pulled block's GEMM follows its copy.

`ChunkedGemmReduceScatter`: c_shard = reduce_scatter(a @ b). The GEMM computes the rows each peer
owns into my send slot, the peer after me first, and says "ready" to that peer after each block;
then my own rows. A side stream per peer pulls my rows of that peer's product as soon as that peer
says ready: pulled one after another, a peer that came late held back the blocks of the peers behind
it in the stream. (It does not make the copies faster: what one GPU takes in by the copy engine is
~270-315 GB/s however they are issued, bench/notes/prefill.md section 6.) One kernel sums the W
partials in rank order (fp32), so the result does not depend on the arrival order.

State lives in device memory (the call number, the flags) and the copies' addresses never change, so
calls can be captured in CUDA graphs. A case they do not take goes to the sequential op (stock
collective + matmul), as the one-launch ops do. Host work per call: W GEMMs, W - 1 copies and W - 1
waits (one per peer's block: that is the chunking), and four (AG) or W + 1 (RS) one-program kernels; the waits
and signals launch directly (launch.Launcher), their arguments fixed per op."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.chunked import (begin_call_kernel, nan_if_failed_kernel, reduce_rows_kernel,
                                                   signal_kernel, wait_ready_kernel)
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.ops.device import cache_modifiers, pull_lanes, resident_programs
from tp_overlap_plugin.ops.operands import check_operands, kernel_applies
from tp_overlap_plugin.ops.slots import round_up

REDUCE_TILE = (32, 128)     # RS's sum: rows, columns per tile
NAN_BLOCK = 1024            # elements per store of a give-up's NaN fill
ALL_PEERS = -1


class _ChunkedOp:
    """What both ops share: the send slot [blocks, max_rows, cols] and the ready and pulled words [W]
    in the heap; the landed blocks [W - 1, max_rows, cols] in ordinary memory; the call counter; the
    side streams the pulls run on (`lanes`: one, peer after peer, or one per peer, all at once); the
    one-program kernels' launchers."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, cols: int, dtype: torch.dtype, device_group,
                 blocks: int, name: str, lanes: int = 1):
        if max_rows < 1 or cols < 1:
            raise ValueError(f"{type(self).__name__} needs max_rows and cols >= 1; got {max_rows}, {cols}")
        self.heap, self.max_rows, self.cols, self.dtype = heap, max_rows, cols, dtype
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W, me, dev = heap.world_size, heap.rank, heap.device
        peers = max(W - 1, 1)
        self.send = heap.alloc((blocks, max_rows, cols), dtype, name=f"{name}.send")
        self.ready = heap.alloc((W,), torch.int64, name=f"{name}.ready")
        self.pulled = heap.alloc((W,), torch.int64, name=f"{name}.pulled")
        self.ready.zero_()
        self.pulled.zero_()
        self.landed = torch.empty((peers, max_rows, cols), dtype=dtype, device=dev)
        self.calls = torch.zeros(1, dtype=torch.int64, device=dev)
        self.sides = [torch.cuda.Stream(dev) for _ in range(min(lanes, peers))] if dev.type == "cuda" else None
        self.side = self.sides[0] if self.sides else None
        self.events = [torch.cuda.Event() for _ in range(peers)] if self.side is not None else None
        self.begun = torch.cuda.Event() if self.side is not None else None
        self.stream_order = runtime.StreamOrder()
        comm = dict(calls_ptr=self.calls, rank=me, heap_bases=heap.heap_bases, error_ptr=heap.error, num_warps=1)
        self._begin = Launcher(begin_call_kernel, dev, (), pulled_ptr=self.pulled, WORLD=W,
                               POLL_LOAD=cache_modifiers(dev)["POLL_LOAD"], **comm)
        self._signal_ready = {dst: Launcher(signal_kernel, dev, (), flags_ptr=self.ready, dst=dst, WORLD=W, **comm)
                              for dst in [ALL_PEERS] + [q for q in range(W) if q != me]}
        self._signal_pulled = Launcher(signal_kernel, dev, (), flags_ptr=self.pulled, dst=ALL_PEERS, WORLD=W, **comm)
        heap.publish()

    @staticmethod
    def _heap_bytes(world: int, blocks: int, max_rows: int, cols: int, dtype: torch.dtype) -> int:
        es = torch.empty((), dtype=dtype).element_size()
        return round_up(blocks * max_rows * cols * es, 256) + 2 * round_up(world * 8, 256)

    def _wait_launcher(self, src: int) -> Launcher:
        """The wait for `src`'s ready word."""
        return Launcher(wait_ready_kernel, self.heap.device, (), ready_ptr=self.ready, calls_ptr=self.calls, src=src,
                        rank=self.heap.rank, heap_bases=self.heap.heap_bases, error_ptr=self.heap.error, num_warps=1)

    def _mark_begun(self) -> None:
        """Record where the side stream may start: after this call's begin and the last call's reads of
        the landed blocks (both on the caller's stream, before this point)."""
        if self.side is not None:
            self.begun.record()

    def _fork(self, lane: int = 0):
        """Side stream `lane`, after `_mark_begun`'s point of the caller's stream (not after the GEMMs the
        host queued since); a no-op context on the CPU."""
        if self.side is None:
            return contextlib.nullcontext()
        self.sides[lane].wait_event(self.begun)
        return torch.cuda.stream(self.sides[lane])

    def _pull(self, rows: int) -> None:
        """Peer j's block on side stream j % lanes, in `srcs` order on each: wait for its ready word,
        copy its block's first `rows` rows into the landed slot (the copy engine) and record the block's
        event (AG's GEMM of that block waits for it); then, on the first side stream once every copy is
        done, tell every peer its blocks were pulled. The first lane is queued last, so the others'
        events it waits for are already recorded."""
        lanes = len(self.sides) if self.sides else 1
        for lane in reversed(range(lanes)):
            with self._fork(lane):
                for j in range(lane, len(self.srcs), lanes):
                    self._waits[j](1)
                    self.landed[j, :rows].copy_(self._theirs[j][:rows])
                    if self.events is not None:
                        self.events[j].record()
                if lane == 0:
                    for j in range(len(self.srcs)):
                        if j % lanes:  # the other lanes' copies
                            self.side.wait_event(self.events[j])
                    self._signal_pulled(1)

    def _await_landed(self) -> None:
        """The caller's stream waits for every block's copy (not for what the pull streams run after them)."""
        if self.events is not None:
            cur = torch.cuda.current_stream(self.heap.device)
            for ev in self.events:
                cur.wait_event(ev)

    def _join(self) -> None:
        """The caller's stream waits for the first side stream (which waited for the others): a graph capture
        must end on the stream it began on, every stream it forked joined."""
        if self.side is not None:
            torch.cuda.current_stream(self.heap.device).wait_stream(self.side)


class ChunkedAllGatherGemm(_ChunkedOp):
    """c = all_gather(a_shard) @ b with the vendor GEMM per peer's block; capacity `max_rows` rows per
    shard of `k` columns, fixed at construction (the heap is symmetric)."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None):
        super().__init__(heap, max_rows, k, dtype, device_group, 1, "chunked_ag",
                         lanes=pull_lanes(heap.device, heap.world_size))
        W, me = heap.world_size, heap.rank
        self.srcs = [(me + 1 + j) % W for j in range(W - 1)]  # pull order: each step a permutation of ranks
        self._waits = [self._wait_launcher(src) for src in self.srcs]
        # after a give-up, NaN over the peers' rows of c (kernels/chunked.py: in my memory, after the GEMMs)
        self._nan_if_failed = Launcher(nan_if_failed_kernel, heap.device, ("out_ptr", "numel", "keep_start", "keep_end"),
                                       error_ptr=heap.error, BLOCK=NAN_BLOCK, num_warps=4)
        # what the copy engine reads: each src's send slot, as a tensor of this process
        self._theirs = [heap.peer_view(self.send[0], src) for src in self.srcs]

    @staticmethod
    def heap_bytes(world: int, max_rows: int, cols: int, dtype: torch.dtype) -> int:
        return _ChunkedOp._heap_bytes(world, 1, max_rows, cols, dtype)

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
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        self._begin(1)
        self.send[0, :rows].copy_(a_shard)
        self._signal_ready[ALL_PEERS](1)  # launched before the waits (kernels/chunked.py)
        self._mark_begun()
        self._pull(rows)
        cur = torch.cuda.current_stream(h.device) if self.side is not None else None
        torch.mm(a_shard, b, out=c[me * rows:(me + 1) * rows])
        for j, src in enumerate(self.srcs):
            if cur is not None:
                cur.wait_event(self.events[j])
            torch.mm(self.landed[j, :rows], b, out=c[src * rows:(src + 1) * rows])
        self._join()
        self._nan_if_failed(1, c, c.numel(), me * rows * n, (me + 1) * rows * n)
        h.check_if_free()
        return c


class ChunkedGemmReduceScatter(_ChunkedOp):
    """c_shard = reduce_scatter(a @ b) with the vendor GEMM per peer's block of rows: rank r gets rows
    [r * M / W, (r + 1) * M / W) of the sum over ranks. M not divisible by W is padded with zero
    rows (they come back as zeros at the end of the last rank's shard), as GemmReduceScatter does.
    Capacity `max_rows` rows per shard of `n` columns."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None):
        W, me = heap.world_size, heap.rank
        super().__init__(heap, max_rows, n, dtype, device_group, max(W - 1, 1), "chunked_rs", lanes=W - 1)
        # send block j holds the rows of rank me + 1 + j, computed in that order; so rank src computes
        # mine as its block (me - src - 1) mod W, and I pull from me - 1 first
        self.dsts = [(me + 1 + j) % W for j in range(W - 1)]
        self.srcs = [(me - 1 - j) % W for j in range(W - 1)]
        self._waits = [self._wait_launcher(src) for src in self.srcs]
        # what the copy engine reads: src's block for me, as a tensor of this process
        self._theirs = [heap.peer_view(self.send[j], src) for j, src in enumerate(self.srcs)]
        self._reduce = Launcher(reduce_rows_kernel, heap.device, ("own_ptr", "out_ptr", "rows"), landed_ptr=self.landed,
                                N=n, slot_stride=max_rows * n, rank=me, error_ptr=heap.error, WORLD=W,
                                BLOCK_M=REDUCE_TILE[0], BLOCK_N=REDUCE_TILE[1])

    @staticmethod
    def heap_bytes(world: int, max_rows: int, cols: int, dtype: torch.dtype) -> int:
        return _ChunkedOp._heap_bytes(world, max(world - 1, 1), max_rows, cols, dtype)

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
        self._begin(1)
        self._mark_begun()
        # every signal of the call is launched before any wait of it (kernels/chunked.py: a kernel
        # loaded lazily while a wait spins waits for that wait to end)
        for j, dst in enumerate(self.dsts):
            torch.mm(a[dst * rows:(dst + 1) * rows], b, out=self.send[j, :rows])
            self._signal_ready[dst](1)
        own = torch.mm(a[me * rows:(me + 1) * rows], b)
        self._pull(rows)
        # the sum waits for the copies alone; the "pulled" signal after them runs beside it, joined after
        # (it had sat between the last copy and the sum: ~12 us a call, bench/notes/prefill.md section 9)
        self._await_landed()
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        # no waits in the sum: a program per tile (the interpreter's few programs walk them all)
        tiles = -(-rows // REDUCE_TILE[0]) * -(-n // REDUCE_TILE[1])
        self._reduce(tiles if h.device.type == "cuda" else min(tiles, resident_programs(h.device)), own, c, rows)
        self._join()
        h.check_if_free()
        return c
