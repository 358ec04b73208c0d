"""What a kernel launch needs to know of its device: grid sizes for kernels that wait on peers, the warp
width the receive tiles are sized by, and the cache modifiers peer memory needs on CDNA. The interpreter
(device cpu) gets what keeps its serial programs correct."""

from __future__ import annotations

import torch

from tp_overlap_plugin import runtime


def num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM. The interpreter runs programs one after another;
    one program walks all tiles in order there."""
    return resident_programs(device, cross_program_waits=True)


def warp_size(device: torch.device) -> int:
    """Threads of a warp (a wavefront on CDNA): the receive tiles are sized per thread
    (kernels/lamport.py: tile_elems). The interpreter's programs are sized as on NVIDIA."""
    return runtime.warp_size(device) if device.type == "cuda" else 32


def resident_programs(device: torch.device, cross_program_waits: bool = False) -> int:
    """Grid size of a kernel that spins on peers: one program per SM at most, so every program is
    resident at once and none spins on a peer program that its own rank has not scheduled. The
    interpreter runs a grid's programs one after another, so a kernel whose programs wait on other
    programs of their own rank (`cross_program_waits`) gets one program there."""
    if device.type == "cuda":
        return runtime.multiprocessor_count(device)
    return 1 if cross_program_waits else 4


def cache_modifiers(device: torch.device) -> dict:
    """On CDNA, stores to peer memory stay in the sender's L2 unless written through, and polls
    need a cache modifier to stay coherent (kernels/all_reduce.py: _wait_landed)."""
    cdna = device.type == "cuda" and torch.version.hip is not None
    return {"PEER_STORE": ".wt" if cdna else "", "POLL_LOAD": ".cv" if cdna else ""}


def pull_lanes(device: torch.device, world: int) -> int:
    """How many peers' blocks the chunked AG pulls at once (ops/chunked.py; its RS pulls every peer at
    once everywhere). On CDNA (MI300X) each peer is a link of its own, ~48 GB/s a direction of the
    seven: pulled one at a time, a block would take 1/(W - 1) of what the GPU can take in, so one
    stream per peer. Behind NVIDIA's NVSwitch one peer's copy takes the whole ingress (H200x4: 259
    GB/s one at a time against 270 at once, bench/notes/prefill.md section 6), and one at a time lets
    the first block's GEMM start soonest: one stream. bench/notes/prefill.md section 10."""
    cdna = device.type == "cuda" and torch.version.hip is not None
    return max(world - 1, 1) if cdna else 1
