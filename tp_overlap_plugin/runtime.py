"""What the host ops take from torch's runtime: the device's multiprocessor count (read once), whether
a CUDA graph is being captured, and the stock torch.distributed collectives that every path falls
back to (gloo has no reduce-scatter, so that one is an all-reduce and a slice there)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def capturing(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Rows [r*M/W, (r+1)*M/W) of the sum over ranks, on rank r."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x.chunk(world)[dist.get_rank(group)].clone()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out
