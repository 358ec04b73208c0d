"""Receive slots in the heap. Row slots ([2 alternating calls, W source ranks, rows, padded columns])
hold a float dtype as its bits, so that NOT_YET (all ones, a NaN pattern no sum produces) marks a value
not yet landed (kernels/lamport.py): the one-shot all-reduce, the fused all-reduce + norm and GEMM +
all-reduce exchange rows through them. AG-GEMM and GEMM-RS have peer slots: W - 1 per call parity, with
arrival counts instead of a marker per value."""

from __future__ import annotations

import torch

from tp_overlap_plugin.heap import SymmetricHeap

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
    ranks, max_rows, n padded], NOT_YET in every element (kernels/allreduce.py). The fused
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

