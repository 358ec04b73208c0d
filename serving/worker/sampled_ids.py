"""Tokens sampled by one step that the next step reads while they are still on the device.

Under async scheduling rank 0 launches step i+1 before step i's tokens reach the host. Such a step's
input id -(k + 1) stands for the k-th token step i sampled (step_message.StepInput). Rank 0 writes step
i's tokens into every rank's `SampledIds` buffer on the device (a broadcast queued on the stream like
the forward), and each rank replaces the references in its step's ids in place before the model
reads them: one Triton launch on GPUs, also inside a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])   # the step's token count: one variant for every step
def _resolve_refs_kernel(ids_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    """ids[i] = sampled[-ids[i] - 1] where ids[i] < 0, in one launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    ref = ids < 0
    got = tl.load(sampled_ptr + tl.maximum(-ids - 1, 0), mask=mask & ref, other=0)
    tl.store(ids_ptr + offs, tl.where(ref, got, ids), mask=mask)


class SampledIds:
    """Every rank's copy of the latest step's sampled ids (at most `capacity`, max_num_seqs)."""

    def __init__(self, capacity: int, device: torch.device, group: Optional[dist.ProcessGroup]):
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.group = group   # the model group; None at TP=1

    def share(self, tokens: torch.Tensor) -> None:
        """Rank 0: this step's sampled ids, for the next step's input on every rank. Stays on the
        device; on GPUs the broadcast is queued on the stream like the forward."""
        self.buffer[:tokens.numel()].copy_(tokens)
        if self.group is not None:
            dist.broadcast(self.buffer, src=0, group=self.group)

    def receive(self) -> None:
        """Ranks > 0: rank 0's `share` of the step just run."""
        dist.broadcast(self.buffer, src=0, group=self.group)

    def resolve(self, ids: torch.Tensor) -> None:
        """Replace in place the ids that stand for sampled tokens."""
        if ids.device.type == "cuda":
            n = ids.numel()
            _resolve_refs_kernel[(triton.cdiv(n, 1024),)](ids, self.buffer, n, BLOCK=1024)
            return
        ref = (-ids - 1).clamp_(min=0)
        ids.copy_(torch.where(ids < 0, self.buffer.gather(0, ref), ids))
