"""The heap backend on torch symmetric memory (CUDA; ROCm where torch supports it): one
`symm_mem.empty` region per rank, peers' buffers from the rendezvous handle."""

from __future__ import annotations

import torch


class TorchSymmBackend:
    def __init__(self, heap):
        self.heap = heap

    def map(self):
        import torch.distributed._symmetric_memory as symm_mem
        h = self.heap
        group_name = h.group.group_name  # torch >= 2.11 needs no enable_symm_mem_for_group first
        with torch.cuda.device(h.device):
            self.local = symm_mem.empty(h.heap_size, dtype=torch.uint8, device=h.device)
            self.handle = symm_mem.rendezvous(self.local, group_name)
        peers = [self.handle.get_buffer(r, (h.heap_size,), torch.uint8) if r != h.rank else self.local
                 for r in range(h.world_size)]
        return self.local, peers

    def close(self):
        pass
