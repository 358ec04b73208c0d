"""AG-GEMM, `AllGatherGemm`: c = all_gather(a_shard) @ b in one persistent launch (kernels/ag_gemm.py),
and `push_plan`, how its programs split between pushing my shard and multiplying."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.gemm_config import TileConfig
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
from tp_overlap_plugin.ops.operands import check_operands, fused_config, kernel_applies
from tp_overlap_plugin.ops.slots import PeerSlotOp

# AG-GEMM's push (kernels/ag_gemm.py). A piece is the unit a pusher moves before its releasing
# add, which waits for the piece's stores to land: large enough that the wait is a small share of
# the piece's time at one program's store rate (~25-45 GB/s into a peer, bench/notes/ag_gemm.md),
# small enough that the first pieces land early.
PIECE_BYTES = 256 << 10

PUSH_STEP_ELEMS = 16384      # elements one push step moves (32 KB of bf16: 64-128 B per thread)

PUSHERS_PER_PEER = 8         # ~8 programs fill the links to one peer (bench/results/remote-bw-tp2-*)

# AG-GEMM multiplies the peers' rows in this many runs of row blocks, a wait before each (a constexpr:
# one kernel per world size; runs beyond the shard's row blocks are empty). Each run is one more copy
# of the tile loop in the compiled kernel: with 2, ptxas takes 1.2x as long as on v3's kernel, with
# 4 over 2x (sm_90, bench/notes/ag_gemm.md); 2 already end a link-bound shape about one run's
# compute after the link.
AG_SEGMENTS = 2

# The device's dense 16-bit FLOP/s over the bytes per second it pushes into its peers: H200 ~750
# TFLOP/s over ~340 GB/s (DESIGN.md section 9). push_plan's estimate of when the pushes end, in
# units of the GEMM's time; tune measures plans in its stead.
FLOPS_PER_PUSHED_BYTE = 2200


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """How AG-GEMM's programs move my shard into the peers' heaps (kernels/ag_gemm.py)."""
    pushers: int     # the first `pushers` programs push, then join the GEMM
    piece_rows: int  # rows per piece (one releasing add per piece and peer); a power of two dividing BLOCK_M
    push_cols: int   # columns per push step (a power of two)
    join: int = 0    # the first segment of peers' rows the pushers multiply (the others take the earlier alone)


def push_plan(rows: int, n: int, k: int, elem_bytes: int, world: int, programs: int, block_m: int,
              segments: int = AG_SEGMENTS) -> PushPlan:
    """The default: PUSHERS_PER_PEER programs per peer, at most a quarter of the SMs (one program
    where the grid is one: the interpreter); pieces of about PIECE_BYTES. The pushers join at the
    first segment the others would not have started yet when the pushes end, by the estimate
    T_push / T_gemm = (W - 1) / W * FLOPS_PER_PUSHED_BYTE * elem_bytes / (2 N): until then the
    others multiply my rows (1 / W of the GEMM) and the earlier segments."""
    pushers = min(max(1, min(PUSHERS_PER_PEER * (world - 1), programs // 4)), programs)
    piece_rows = 1 << max(0, (PIECE_BYTES // max(k * elem_bytes, 1)).bit_length() - 1)
    piece_rows = min(piece_rows, block_m)  # not clamped to the rows: one kernel per tile config
    push_cols = min(triton.next_power_of_2(k), max(16, PUSH_STEP_ELEMS // piece_rows))
    used = min(segments, -(-rows // block_m))  # segments that hold row blocks
    slower = programs / max(programs - pushers, 1)  # the others' time for a share of the whole grid's
    push_end = (world - 1) / world * FLOPS_PER_PUSHED_BYTE * elem_bytes / (2 * n)
    join = 0
    while join < used - 1 and slower * (1 + join * (world - 1) / used) / world < push_end:
        join += 1
    return PushPlan(pushers, piece_rows, push_cols, join)


class AllGatherGemm(PeerSlotOp):
    """c = all_gather(a_shard) @ b, the gather hidden behind the GEMM, in one persistent launch
    (kernels/ag_gemm.py): a few of its programs push my shard into every peer's heap at once, piece
    by piece, each piece followed by a count in that peer's heap; the others multiply my rows, and
    all of them the peers' rows, run by run of row blocks as their pieces are counted in. The rows a
    peer delivered stay in `gathered[half, slot]` (half = the call number's parity, slot =
    (src - me - 1) mod W) until the call after next.

    Capacity is fixed at construction (heap space is symmetric): `max_rows` rows per shard, `k`
    columns. Every call's state (call number) lives in device memory, so calls can be captured in
    CUDA graphs and replayed; a call is one launch, with no host work per peer."""

    NAME, SLOTS, COLS, RUNS_ARG, RUNS = "ag_gemm", "gathered", "k", "segments", AG_SEGMENTS

    def __init__(self, heap: SymmetricHeap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, segments: int = AG_SEGMENTS):
        super().__init__(heap, max_rows, k, dtype, device_group, segments)

    def received(self, src: int, rows: int) -> torch.Tensor:
        """The rows rank `src` delivered for the last finished call (tests read them)."""
        half = int(self.calls[1]) % 2
        return self.gathered[half, (src - self.heap.rank - 1) % self.heap.world_size, :rows]

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, config: TileConfig | None = None,
                 plan: PushPlan | None = None) -> torch.Tensor:
        h = self.heap
        check_operands("ag_gemm", a_shard, b, h.device)
        rows, k = a_shard.shape
        n = b.shape[1]
        W = h.world_size
        fits = rows <= self.max_rows and k == self.k and a_shard.dtype == self.dtype
        if rows == 0 or n == 0 or W == 1 or not fits or not kernel_applies(a_shard):
            stats.record("ag_gemm.fallback")
            return runtime.all_gather(a_shard, self.device_group) @ b
        self.stream_order.before_call(h.device)
        stats.record("ag_gemm.kernel")
        cfg = fused_config(rows, n, k, h.device, config)
        plan = plan or push_plan(rows, n, k, a_shard.element_size(), W, self.programs, cfg.block_m, self.segments)
        if cfg.block_m % plan.piece_rows or plan.pushers < 1:
            raise ValueError(f"ag_gemm: {plan} needs pushers >= 1 and piece_rows dividing BLOCK_M={cfg.block_m}")
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        ag_gemm_kernel[(self.programs,)](
            a_ptr=a_shard, b_ptr=b, c_ptr=c, gathered_ptr=self.gathered, counts_ptr=self.counts, calls_ptr=self.calls,
            rows=rows, N=n, K=k, stride_bk=b.stride(0), stride_bn=b.stride(1), slot_stride=self.max_rows * k,
            pushers=plan.pushers, join=plan.join, rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error, WORLD=W,
            SEGMENTS=self.segments, PIECE_ROWS=plan.piece_rows, PUSH_COLS=plan.push_cols, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
            INTERPRET=h.device.type == "cpu", FLATTEN=cfg.flatten, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        h.check_if_free()
        return c
