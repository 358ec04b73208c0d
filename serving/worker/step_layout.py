"""A step's per-token inputs, derived on the host with whole-array numpy ops, and moved to the device
without holding the host.

A step is described per sequence (tokens this step, tokens in the cache after it, block table); the
position and cache slot of every token follow from that, so they are computed here on each rank
instead of being built token by token and sent: sequence s's tokens sit at positions
[context_len - q_len, context_len), and position p lives in slot block_table[p // B] * B + p % B.

`Staging` fills pinned host buffers and issues one asynchronous copy per dtype. A copy from pageable
memory (torch.tensor(list, device="cuda")) waits for the stream to drain first, so the host could
not queue step i+1 while step i runs; from pinned memory it returns at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class Layout:
    positions: np.ndarray      # [T] int64
    slots: np.ndarray          # [T] int64
    cu_seqlens: np.ndarray     # [S + 1] int32
    block_tables: np.ndarray   # [S, W] int32, padded with the scratch block


def block_table_matrix(tables: list[list[int]], pad: int, width: Optional[int] = None,
                       out: Optional[np.ndarray] = None) -> np.ndarray:
    """Ragged tables -> [S, width] int32 padded with `pad` (into `out` when given)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lens.max(initial=1)) if width is None else width
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    bt = np.empty((len(tables), width), dtype=np.int32) if out is None else out
    bt.fill(pad)
    bt[np.arange(width)[None, :] < lens[:, None]] = flat
    return bt


def layout(q_lens: list[int], context_lens: list[int], tables: list[list[int]], block_size: int, pad: int,
           width: Optional[int] = None, bt_out: Optional[np.ndarray] = None) -> Layout:
    q = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    t = int(cu[-1])
    seq = np.repeat(np.arange(len(q)), q)
    # token i of sequence s: position (ctx_s - q_s) + (i - cu_s)
    pos = np.arange(t, dtype=np.int64) + np.repeat(ctx - q - cu[:-1], q)
    bt = block_table_matrix(tables, pad, width, bt_out)
    slots = bt[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return Layout(pos, slots, cu.astype(np.int32), bt)


def _aligned_offsets(parts: list[np.ndarray], align: int) -> list[int]:
    """Where each array starts in a buffer holding them in turn, every start a multiple of `align`
    elements; the last entry is the buffer's length."""
    at = [0]
    for a in parts:
        at.append(-(-(at[-1] + a.size) // align) * align)
    return at


class Staging:
    """Pinned host buffers for a step's inputs, two sets used in turn: a set is written again only
    after the copy that read it two steps ago has finished (its event), which async scheduling has
    long passed by then. Grows when a step needs more room."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sets: list = [None, None]   # (int64 buffer, int32 buffer, event)
        self.turn = 0

    def _buffers(self, n64: int, n32: int):
        i = self.turn
        self.turn ^= 1
        cur = self.sets[i]
        if cur is not None:
            cur[2].synchronize()
        if cur is None or cur[0].numel() < n64 or cur[1].numel() < n32:
            prev = (cur[0].numel(), cur[1].numel()) if cur is not None else (0, 0)
            cur = (torch.empty(max(n64, 2 * prev[0]), dtype=torch.int64, pin_memory=True),
                   torch.empty(max(n32, 2 * prev[1]), dtype=torch.int32, pin_memory=True), torch.cuda.Event())
            self.sets[i] = cur
        return cur

    def to_device(self, parts64: list[np.ndarray], parts32: list[np.ndarray]) -> tuple[list, list]:
        """The arrays as device tensors (1-D views of two fresh device buffers), in two copies. Each
        view starts 16-byte aligned: Triton compiles a kernel per pointer alignment, and views packed
        back to back would have an alignment that changes with the step's sizes, compiling kernels
        mid-serving."""
        offsets = [_aligned_offsets(parts, 16 // np.dtype(dt).itemsize) for parts, dt in
                   ((parts64, np.int64), (parts32, np.int32))]
        h64, h32, ev = self._buffers(offsets[0][-1], offsets[1][-1])
        out = []
        for host, parts, at in ((h64, parts64, offsets[0]), (h32, parts32, offsets[1])):
            view = host.numpy()
            for a, i in zip(parts, at):
                view[i:i + a.size] = a.ravel()
            dev = torch.empty(at[-1], dtype=host.dtype, device=self.device)
            dev.copy_(host[:at[-1]], non_blocking=True)
            out.append([dev[i:i + a.size].view(a.shape) for a, i in zip(parts, at)])
        ev.record()
        return out[0], out[1]
