"""A step, and how rank 0 ships it to the other ranks.

`StepInput` describes a step per sequence; every token's position and cache slot follow from it
(serving/worker/step_layout.py). `StepMessage` packs it into one flat int64 tensor and broadcasts it over the
gloo control group, so that no Python object is pickled per step; every rank, rank 0 included, then
runs the same forward (runner.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class StepInput:
    """A step, per sequence: every token's position and cache slot follow from q_lens, context_lens
    and block_tables (serving/worker/step_layout.py), so they are neither built nor sent token by token."""
    input_ids: list[int]
    q_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    logit_rows: list[int]     # token rows whose logits the step must return
    # Async scheduling: after this step rank 0 broadcasts its sampled ids into every rank's `sampled`.
    share_sampled: bool = False
    # An input id -(k + 1) stands for the k-th token sampled by the previous step, which is still on
    # the device when this step is launched (async scheduling): every rank holds it in `sampled`.


class StepMessage:
    """A step (or the stop command) as one flat int64 tensor, so that no Python object is pickled per
    step. Layout: a header [command, tokens, sequences, decodes, logit rows, flags, body length], then the
    body: input ids (one per token), q lens, context lens, table lengths (one per sequence), logit rows,
    and the block tables back to back. Tables are sent ragged: at batch 256 a padded matrix would be
    mostly padding.

    The message travels in a fixed buffer of CAPACITY entries, which holds a decode step of up to ~100
    sequences at a few-thousand-token context; a longer one sends its tail in a second broadcast of a
    length both sides read from the header. Rank 0 broadcasts asynchronously and only waits for the
    transfer when it needs the buffer again (two of them alternate), so its own launch never waits on
    gloo."""

    HEADER = 7
    CAPACITY = 4096
    STEP, STOP = 1, 2
    SHARE_SAMPLED = 1   # flags

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.bufs = [torch.zeros(self.CAPACITY, dtype=torch.int64) for _ in range(2)]
        self.pending: list = [None, None]      # rank 0: the broadcasts still reading each buffer
        self.turn = 0

    @classmethod
    def encode(cls, step: Optional[StepInput]) -> list[int]:
        if step is None:
            return [cls.STOP, 0, 0, 0, 0, 0, 0]
        body = list(itertools.chain(step.input_ids, step.q_lens, step.context_lens, map(len, step.block_tables),
                                    step.logit_rows, itertools.chain.from_iterable(step.block_tables)))
        flags = cls.SHARE_SAMPLED if step.share_sampled else 0
        return [cls.STEP, len(step.input_ids), len(step.q_lens), step.num_decodes, len(step.logit_rows), flags,
                len(body)] + body

    @classmethod
    def decode(cls, msg: list[int]) -> Optional[StepInput]:
        cmd, n, s, nd, r, flags, _ = msg[:cls.HEADER]
        if cmd == cls.STOP:
            return None
        if cmd != cls.STEP:
            raise RuntimeError(f"step message with unknown command {cmd}: the ranks are out of step")
        it = iter(msg[cls.HEADER:])
        take = lambda k: list(itertools.islice(it, k))   # noqa: E731
        ids, q_lens, ctx, widths, rows = take(n), take(s), take(s), take(s), take(r)
        return StepInput(ids, q_lens, ctx, [take(w) for w in widths], nd, rows,
                         bool(flags & cls.SHARE_SAMPLED))

    def send(self, step: Optional[StepInput]) -> None:
        msg = self.encode(step)
        i = self.turn
        self.turn ^= 1
        for work in self.pending[i] or ():
            work.wait()
        buf, cap = self.bufs[i], self.CAPACITY
        head = msg[:cap]
        buf[:len(head)] = torch.tensor(head, dtype=torch.int64)
        works = [dist.broadcast(buf, src=0, group=self.group, async_op=True)]
        if len(msg) > cap:
            tail = torch.tensor(msg[cap:], dtype=torch.int64)
            works.append(dist.broadcast(tail, src=0, group=self.group, async_op=True))
        self.pending[i] = works
        if step is None:
            self.flush()

    def flush(self) -> None:
        for i, works in enumerate(self.pending):
            for work in works or ():
                work.wait()
            self.pending[i] = None

    def recv(self) -> Optional[StepInput]:
        buf, cap = self.bufs[0], self.CAPACITY
        dist.broadcast(buf, src=0, group=self.group)
        total = self.HEADER + int(buf[self.HEADER - 1])
        msg = buf[:min(total, cap)].tolist()
        if total > cap:
            tail = torch.empty(total - cap, dtype=torch.int64)
            dist.broadcast(tail, src=0, group=self.group)
            msg += tail.tolist()
        return self.decode(msg)
