"""Noticing, without a device sync per step, that a kernel of a step gave up waiting on a peer."""

from __future__ import annotations

from typing import Optional

import torch


class ErrorWatch:
    """The heap's error word (a spin-wait that gave up on a peer writes it), read without holding the
    host until the device has caught up.

    After each step a copy of the word into pinned memory is queued behind the step's work, in a ring
    of DEPTH slots. `check(slot)` reads the step's copy once the host has waited for that step anyway
    (rank 0: its sampled tokens, copied after it), so a failed step raises before any token it
    produced is used. `after_step` also reads the copy of the step DEPTH steps back, waiting for it
    if need be: a rank that never waits on its tokens (a worker) raises at most DEPTH steps late, and
    never runs more than DEPTH steps ahead of its device.

    Without a device to wait for (the CPU, unless `lagged`), every step checks the word directly."""

    DEPTH = 4

    def __init__(self, heap, lagged: Optional[bool] = None):
        self.heap = heap
        self.lagged = heap.error.device.type == "cuda" if lagged is None else lagged
        self.cuda = heap.error.device.type == "cuda"
        self.steps = 0
        if self.lagged:
            host = torch.zeros(self.DEPTH, dtype=torch.int64)
            self.host = host.pin_memory() if self.cuda else host
            self.view = self.host.numpy()
            self.events: list = [None] * self.DEPTH
            self.queued = [False] * self.DEPTH

    def _read(self, slot: int) -> None:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        if self.view[slot] != 0:
            self.heap.check()   # reads the whole error record (a sync, on the way to an exception)

    def after_step(self) -> int:
        """Queue this step's copy of the error word; returns its slot for `check`."""
        if not self.lagged:
            self.heap.check()
            return -1
        slot = self.steps % self.DEPTH
        self.steps += 1
        if self.queued[slot]:
            self._read(slot)
        self.host[slot:slot + 1].copy_(self.heap.error[:1], non_blocking=True)
        self.queued[slot] = True
        if self.cuda:
            if self.events[slot] is None:
                self.events[slot] = torch.cuda.Event()
            self.events[slot].record()
        return slot

    def check(self, slot: int) -> None:
        """Raise RankTimeoutError if the step of `slot` (or an earlier one) failed. Call it once the
        host has waited for that step's results: then it waits for nothing."""
        if slot >= 0:
            self._read(slot)
