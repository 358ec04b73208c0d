"""Receive slots in the heap. Row slots ([2 alternating calls, W source ranks, rows, padded columns])
hold a float dtype as its bits, so that NOT_YET (all ones, a NaN pattern no sum produces) marks a value
not yet landed (kernels/lamport.py): the one-shot all-reduce, the fused all-reduce + norm and GEMM +
all-reduce exchange rows through them. AG-GEMM and GEMM-RS have peer slots: W - 1 per call parity, with
arrival counts instead of a marker per value."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.ops.device import num_programs

BITS = {2: torch.int16, 4: torch.int32}  # a float dtype's bits, by element size


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Rows of a row-layout receive slot are padded to this many elements: every row starts 16-byte
# aligned (vector pushes) and the row stride is divisible by 16, which Triton specializes on.
SLOT_ROW_ALIGN = 16


def row_slots_bytes(world: int, max_rows: int, n: int, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return 2 * world * max_rows * round_up(n, SLOT_ROW_ALIGN) * es


def alloc_row_slots(heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Receive slots for rows of n values of `dtype`, as its bits: [2 alternating calls, W source
    ranks, max_rows, n padded], NOT_YET in every element (kernels/all_reduce.py). The fused
    all-reduce + norm and GEMM + all-reduce exchange rows through them."""
    es = torch.empty((), dtype=dtype).element_size()
    slots = heap.alloc((2, heap.world_size, max_rows, round_up(n, SLOT_ROW_ALIGN)), BITS[es], name=name)
    slots.fill_(-1)
    return slots


def bits_view(buf: torch.Tensor, elsize: int) -> torch.Tensor:
    return buf.view(BITS[elsize])


def peer_slots_bytes(world: int, max_rows: int, cols: int, dtype: torch.dtype, counters: int) -> int:
    """Heap of AG-GEMM's and GEMM-RS's receive slots: two halves (call parity) of W - 1 slots of
    [max_rows, cols], and `counters` int64 arrival counts per slot, each part 256-byte aligned."""
    slots = max(world - 1, 1)
    es = torch.empty((), dtype=dtype).element_size()
    return round_up(2 * slots * max_rows * cols * es, 256) + round_up(2 * slots * counters * 8, 256)


def alloc_peer_slots(heap: SymmetricHeap, max_rows: int, cols: int, dtype: torch.dtype, counters: int,
                     name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """AG-GEMM's and GEMM-RS's receive slots, [2, W - 1, max_rows, cols] of `dtype` (slot j of a
    call parity is written by rank me + 1 + j), and their arrival counts, [2, W - 1, counters] int64,
    zero."""
    slots = max(heap.world_size - 1, 1)
    data = heap.alloc((2, slots, max_rows, cols), dtype, name=name)
    counts = heap.alloc((2, slots, counters), torch.int64, name=name.rsplit(".", 1)[0] + ".counts")
    counts.zero_()
    return data, counts



class PeerSlotOp:
    """What AG-GEMM and GEMM-RS hold alike, fixed at construction (heap space is symmetric): receive
    slots of `max_rows` rows by `cols` columns for `RUNS` runs of row blocks, their arrival counts, the
    call number in device memory (kernels/calls.py: calls capture in CUDA graphs), the grid and the
    stream order. A subclass names them: its slots are the attribute SLOTS (the heap's "<NAME>.<SLOTS>"),
    its columns and runs the attributes COLS and RUNS_ARG, as its constructor's arguments are named."""
    NAME = ""       # the op: "ag_gemm", "gemm_rs"
    SLOTS = ""      # the receive slots' attribute
    COLS = ""       # the slots' columns' attribute (and constructor argument)
    RUNS_ARG = ""   # the runs' attribute (and constructor argument)
    RUNS = 1        # the default number of runs

    def __init__(self, heap: SymmetricHeap, max_rows: int, cols: int, dtype: torch.dtype,
                 device_group: dist.ProcessGroup | None, runs: int):
        if max_rows < 1 or cols < 1 or runs < 1:
            raise ValueError(f"{type(self).__name__} needs max_rows, {self.COLS}, {self.RUNS_ARG} >= 1; got "
                             f"{max_rows}, {cols}, {runs}")
        self.heap, self.max_rows, self.dtype = heap, max_rows, dtype
        setattr(self, self.COLS, cols)
        setattr(self, self.RUNS_ARG, runs)
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        self.slots, self.counts = alloc_peer_slots(heap, max_rows, cols, dtype, runs, f"{self.NAME}.{self.SLOTS}")
        setattr(self, self.SLOTS, self.slots)
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.programs = num_programs(heap.device)
        self.stream_order = runtime.StreamOrder()
        heap.publish()

    @classmethod
    def heap_bytes(cls, world: int, max_rows: int, cols: int, dtype: torch.dtype, runs: int | None = None) -> int:
        """Heap one op takes: two halves of W - 1 receive slots, and their counts."""
        return peer_slots_bytes(world, max_rows, cols, dtype, cls.RUNS if runs is None else runs)
