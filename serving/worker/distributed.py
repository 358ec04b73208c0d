"""The engine's process group: one per engine, every rank a process. `init_distributed` joins it (or
reuses one torchrun or a test made) and picks this rank's device; `destroy_group_bounded` leaves it
without waiting forever on a peer that is gone."""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..config import EngineConfig, default_device

log = logging.getLogger(__name__)


def rank_device(cfg: EngineConfig, rank: int, world_size: int, local_rank: Optional[int] = None) -> torch.device:
    """The device of rank `rank` (init_distributed selects it; rank 0 plans on it before it spawns the others)."""
    if default_device(cfg) != "cuda":
        return torch.device("cpu")
    lr = rank if local_rank is None else local_rank
    if shares_gpus(world_size):
        # correctness checks only (ranks on one GPU are time-sliced): rank r on GPU r % count, as
        # in multirank.run_ranks
        lr %= torch.cuda.device_count()
    return torch.device("cuda", lr)


def init_distributed(cfg: EngineConfig, rank: int, world_size: int, store=None,
                     local_rank: Optional[int] = None):
    """Join (or reuse) the default process group; returns (device, model group, control group)."""
    device = rank_device(cfg, rank, world_size, local_rank)
    if device.type == "cuda":
        if shares_gpus(world_size) and not dist.is_initialized():
            # NCCL refuses two ranks of a communicator on one GPU unless they claim different hosts;
            # then it connects them through its socket transport
            os.environ["NCCL_HOSTID"] = f"tp-overlap-shared-gpu-rank-{rank}"
        torch.cuda.set_device(device)
    if world_size == 1 and not dist.is_initialized():
        return device, None, None
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                      timeout=timedelta(seconds=cfg.dist_timeout_s))
        if store is not None:
            kwargs["store"] = store
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    if dist.get_world_size() != cfg.tensor_parallel_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but tensor_parallel_size="
                         f"{cfg.tensor_parallel_size}; run one process per TP rank")
    group = dist.group.WORLD
    ctrl = group if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return device, group, ctrl


def shares_gpus(world_size: int) -> bool:
    """Whether this engine's ranks share GPUs: TP_OVERLAP_SHARE_GPUS=1 and fewer GPUs than ranks."""
    from tp_overlap_plugin.multirank import sharing_gpus
    return sharing_gpus() and torch.cuda.device_count() < world_size


def destroy_group_bounded(timeout: float = 30.0) -> bool:
    """dist.destroy_process_group(), given up on after `timeout` s. NCCL's teardown talks to the
    peers: on H200x2 a rank-0 destroy that started after the workers had exited never returned.
    So every rank leaves at the same time (rank 0 right after telling the workers to stop) and
    none waits forever: the call runs on a daemon thread that process exit abandons."""
    t = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("torch.distributed teardown did not finish within %.0f s; leaving without it", timeout)
        return False
    return True
