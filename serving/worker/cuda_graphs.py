"""CUDA graphs of whole decode steps, one per batch size (piecewise.py covers the other steps).

A decode batch of n sequences replays the graph of the smallest captured size >= n; the rows past n
are padding that writes the scratch block. The graphs read their inputs from two static device
buffers (int64: ids | positions | slots; int32: context lens | block tables). A replay fills their
pinned host twins and copies them over in three transfers, instead of a dozen small pageable copies
and fills.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..model.attention import AttnMeta
from .step_layout import layout
from .step_message import StepInput


def graph_batch_sizes(configured: Optional[list[int]], max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: the configured ones (default 1, 2, 4, 8, 16, 32, ... 512) up to
    max_num_seqs, and max_num_seqs itself (up to 512)."""
    sizes = configured or ([1, 2, 4, 8] + list(range(16, 513, 16)))
    return sorted({s for s in sizes if s <= max_num_seqs} | ({max_num_seqs} if max_num_seqs <= 512 else set()))


class DecodeGraphs:
    """The decode graphs of one model on one rank: batch size -> (graph, its logits output). Empty
    until `capture` (the CPU and enforce_eager never capture)."""

    def __init__(self, model, kv_caches: list, block_size: int, scratch_block: int, max_blocks_per_seq: int,
                 resolve_refs: Callable[[torch.Tensor], None]):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block, self.width = block_size, scratch_block, max_blocks_per_seq
        self.resolve_refs = resolve_refs
        self.graphs: dict[int, tuple] = {}
        self.max_batch = 0

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, batch_size: int) -> bool:
        return batch_size in self.graphs

    def __getitem__(self, batch_size: int) -> tuple:
        return self.graphs[batch_size]

    def clear(self) -> None:
        """Drop the graphs and the KV cache they write (the engine has shut down)."""
        self.graphs.clear()
        self.kv_caches = []

    def fits(self, step: StepInput) -> bool:
        """Whether `step` replays a graph: a pure decode batch no larger than the largest graph, every
        row of which samples."""
        n = len(step.input_ids)
        return bool(self.graphs and step.num_decodes == n and n <= self.max_batch
                    and step.logit_rows == list(range(n)))

    def capture(self, sizes: list[int], device: torch.device, pool) -> None:
        self.max_batch = max(sizes)
        mb, width = self.max_batch, self.width
        self.h64 = torch.zeros((3, mb), dtype=torch.int64).pin_memory()
        self.h32 = torch.zeros((mb + mb * width,), dtype=torch.int32).pin_memory()
        self.h64[2].fill_(self.scratch_block * self.block_size)
        self.h32[:mb].fill_(1)
        self.h32[mb:].fill_(self.scratch_block)
        self.g64, self.g32 = self.h64.to(device), self.h32.to(device)
        self.g_ids, self.g_pos, self.g_slots = self.g64
        self.g_ctx, self.g_bt = self.g32[:mb], self.g32[mb:].view(mb, width)
        self.inputs_copied = torch.cuda.Event()
        self.inputs_copied.record()
        self.g_cu = torch.arange(mb + 1, dtype=torch.int32, device=device)
        for bs in sorted(sizes, reverse=True):
            meta = AttnMeta(slot_mapping=self.g_slots[:bs], num_decodes=bs, cu_seqlens_q=self.g_cu[:bs + 1],
                            context_lens=self.g_ctx[:bs], block_tables=self.g_bt[:bs], max_q_len=1,
                            use_triton=True)

            def run():
                # Ids of tokens sampled by the step before (async scheduling) are resolved inside the
                # graph: no extra launches between two replays. A step without such ids is unchanged.
                self.resolve_refs(self.g_ids[:bs])
                h = self.model(self.g_ids[:bs], self.g_pos[:bs], meta, self.kv_caches)
                return self.model.compute_logits(h, None)   # every row of a decode batch samples

            with torch.inference_mode():
                run()  # compiles the Triton kernels and warms the allocator outside the capture
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = run()
            pool = g.pool()
            self.graphs[bs] = (g, out)
        torch.cuda.synchronize(device)

    def replay(self, step: StepInput) -> torch.Tensor:
        n = len(step.input_ids)
        bs = next(s for s in sorted(self.graphs) if s >= n)
        mb, width = self.max_batch, self.width
        self.inputs_copied.synchronize()  # the previous replay's transfer has read the host buffers
        h64, ctx, bt = self.h64.numpy(), self.h32[:mb].numpy(), self.h32[mb:].view(mb, width).numpy()
        bt[n:bs] = self.scratch_block
        lay = layout(step.q_lens, step.context_lens, step.block_tables, self.block_size, self.scratch_block,
                     width, bt[:n])
        h64[0, :n], h64[1, :n], h64[2, :n] = step.input_ids, lay.positions, lay.slots
        h64[0, n:bs], h64[1, n:bs], h64[2, n:bs] = 0, 0, self.scratch_block * self.block_size
        ctx[:n], ctx[n:bs] = step.context_lens, 1
        self.g64.copy_(self.h64, non_blocking=True)  # all of it: 24 bytes a row, one contiguous transfer
        self.g_ctx[:bs].copy_(self.h32[:bs], non_blocking=True)
        self.g_bt[:bs].copy_(self.h32[mb:mb + bs * width].view(bs, width), non_blocking=True)
        self.inputs_copied.record()
        g, out = self.graphs[bs]
        g.replay()
        return out[:n]
