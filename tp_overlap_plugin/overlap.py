"""Host ops for the overlapped tensor-parallel matmuls: `gemm`, `AllGatherGemm`, `GemmReduceScatter`.

All three launch the one GEMM core (kernels/gemm.py). Tile shapes come from `pick_config`, a
deterministic function of the shape and device: the fused kernels exchange per-tile flags, so every
rank must tile identically (a per-rank autotuner could pick differently and deadlock).
Cases a kernel does not cover (dtype, layout, capacity) fall back to the stock torch op, never to
a wrong answer; `stats` records which path ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
from tp_overlap_plugin.kernels.gemm import gemm_kernel
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def launch_kwargs(self, k: int, device: torch.device) -> dict:
        # kernels run on CPU tensors only under the Triton interpreter
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m,
                    EVEN_K=k % self.block_k == 0, INTERPRET=device.type == "cpu",
                    num_warps=self.num_warps, num_stages=self.num_stages)


# Measured on H200 (bench/gemm_configs.py; bench/results/gemm-configs-*.md). CDNA3 (MI300X) entries
# are on paper: 256x256 tiles with 2 stages fit its 64 KB LDS and feed its larger matrix cores.
HOPPER_LARGE = TileConfig(128, 256, 64, 8, 8, 3)
HOPPER_SMALL_M = TileConfig(64, 128, 64, 8, 4, 4)
CDNA3_LARGE = TileConfig(256, 256, 64, 4, 8, 2)
CDNA3_SMALL_M = TileConfig(64, 128, 64, 4, 4, 2)
INTERPRETER = TileConfig(32, 32, 32, 4, 4, 1)


def pick_config(rows: int, n: int, k: int, device: torch.device) -> TileConfig:
    """Tiles for a GEMM whose row blocks have `rows` rows (a shard, for the fused ops)."""
    if device.type == "cpu":
        return INTERPRETER
    small = rows <= 64
    if torch.version.hip is not None:
        return CDNA3_SMALL_M if small else CDNA3_LARGE
    return HOPPER_SMALL_M if small else HOPPER_LARGE


def num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM. The interpreter runs programs one after another,
    so there a single program walks all tiles in order (a peer's waits are then always on tiles it
    has already produced)."""
    return 1 if device.type == "cpu" else runtime.multiprocessor_count(device)


def _check_operands(op: str, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: expected 2-D operands, got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a{tuple(a.shape)} @ b{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: dtypes differ: a is {a.dtype}, b is {b.dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def _kernel_applies(a: torch.Tensor) -> bool:
    # the fused kernels index A rows densely (shard offsets, row stride K); B may be any view
    return a.dtype in KERNEL_DTYPES and a.is_contiguous()


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
         config: TileConfig | None = None) -> torch.Tensor:
    """C = A @ B with our persistent Triton GEMM (the core the fused ops share)."""
    _check_operands("gemm", a, b, a.device)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or a.dtype not in KERNEL_DTYPES + (torch.float32,):
        return torch.matmul(a, b, out=out)
    cfg = config or pick_config(m, n, k, a.device)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    grid = (min(tiles, num_programs(a.device)),)
    gemm_kernel[grid](a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                      out.stride(0), out.stride(1), **cfg.launch_kwargs(k, a.device))
    return out


class AllGatherGemm:
    """c = all_gather(a_shard) @ b, the gather hidden behind the GEMM.

    Capacity is fixed at construction (heap space is symmetric): `max_rows` rows per shard, `k`
    columns. Not for CUDA-graph capture: the copy engine's destinations are host-chosen (the
    dispatcher uses it for prefill-sized M, which runs eagerly)."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16,
                 chunks: int = 2, device_group: dist.ProcessGroup | None = None):
        if max_rows < 1 or k < 1 or chunks < 1:
            raise ValueError(f"AllGatherGemm needs max_rows, k, chunks >= 1; got {max_rows}, {k}, {chunks}")
        self.heap, self.max_rows, self.k, self.dtype, self.chunks = heap, max_rows, k, dtype, chunks
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W = heap.world_size
        self.gathered = heap.alloc((2, W, max_rows, k), dtype, name="ag_gemm.gathered")
        self.flags = heap.alloc((W, chunks), torch.int64, name="ag_gemm.flags")
        self.flags.zero_()
        self.epoch = torch.zeros(1, dtype=torch.int64, device=heap.device)
        self.calls = 0
        self.stream = torch.cuda.Stream(heap.device) if heap.device.type == "cuda" else None
        heap.publish()

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool = False,
                 config: TileConfig | None = None):
        h = self.heap
        _check_operands("ag_gemm", a_shard, b, h.device)
        rows, k = a_shard.shape
        n = b.shape[1]
        W = h.world_size
        fits = rows <= self.max_rows and k == self.k and a_shard.dtype == self.dtype
        if rows == 0 or n == 0 or not fits or not _kernel_applies(a_shard):
            stats.record("ag_gemm.fallback")
            a_full = runtime.all_gather(a_shard, self.device_group)
            c = a_full @ b
            return (c, a_full) if return_gathered else c
        if runtime.capturing(h.device):
            raise RuntimeError("AllGatherGemm cannot be captured in a CUDA graph (its copy-engine "
                               "pushes target a host-chosen buffer half); use it eagerly")
        stats.record("ag_gemm.kernel")
        parity = (self.calls + 1) % 2
        self.calls += 1
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        self._push(a_shard, parity, return_gathered)
        cfg = config or pick_config(rows, n, k, h.device)
        ag_gemm_kernel[(num_programs(h.device),)](
            a_shard, self.gathered, b, c, self.flags, self.epoch, rows, n, k,
            a_shard.stride(0), b.stride(0), b.stride(1), self.max_rows * k, h.rank, W, h.heap_bases, h.error, h.spin_limit,
            CHUNKS=self.chunks, **cfg.launch_kwargs(k, h.device))
        if self.stream is not None:
            torch.cuda.current_stream(h.device).wait_stream(self.stream)
        h.check_if_free()
        if return_gathered:
            return c, self.gathered[parity, :, :rows].reshape(W * rows, k)
        return c

    def _push(self, a_shard: torch.Tensor, parity: int, include_self: bool) -> None:
        """Copy-engine pushes of my shard, chunk by chunk, each followed by its flag."""
        h = self.heap
        rows = a_shard.shape[0]
        step = -(-rows // self.chunks)
        main = torch.cuda.current_stream(h.device) if self.stream is not None else None
        if self.stream is not None:
            self.stream.wait_stream(main)
            a_shard.record_stream(self.stream)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            self.epoch.add_(1)
            if self.stream is not None:
                main.wait_stream(self.stream)  # the kernel reads the new epoch; the copies run on
            mine = self.gathered[parity, h.rank]
            for i in range(1, h.world_size):
                peer = (h.rank + i) % h.world_size
                dst = h.peer_view(mine, peer)
                for c in range(self.chunks):
                    lo, hi = c * step, min((c + 1) * step, rows)
                    if lo < hi:
                        dst[lo:hi].copy_(a_shard[lo:hi], non_blocking=True)
                    h.peer_view(self.flags[h.rank, c:c + 1], peer).copy_(self.epoch, non_blocking=True)
            if include_self:
                mine[:rows].copy_(a_shard, non_blocking=True)


class GemmReduceScatter:
    """c_shard = reduce_scatter(a @ b): rank r gets rows [r*M/W, (r+1)*M/W) of the sum over ranks.

    M not divisible by W is padded with zero rows to the next multiple; the padding rows come back
    as zeros at the end of the last rank's shard. Capacity: `max_rows` rows per shard, `n` columns.
    CUDA-graph capturable (its epochs are advanced by the kernel in device memory)."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None):
        if max_rows < 1 or n < 1:
            raise ValueError(f"GemmReduceScatter needs max_rows, n >= 1; got {max_rows}, {n}")
        self.heap, self.max_rows, self.n, self.dtype = heap, max_rows, n, dtype
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W = heap.world_size
        self.programs = num_programs(heap.device)
        self.recv = heap.alloc((2, W, max_rows * n), dtype, name="gemm_rs.recv")
        max_tiles = max(-(-max_rows // cfg.block_m) * -(-n // cfg.block_n)
                        for cfg in (pick_config(max_rows, n, 1, heap.device), pick_config(1, n, 1, heap.device)))
        self.max_tiles = max_tiles
        self.flags = heap.alloc((W, max_tiles), torch.int64, name="gemm_rs.flags")
        self.epochs = heap.alloc((self.programs,), torch.int64, name="gemm_rs.epochs")
        self.flags.zero_()
        self.epochs.zero_()
        heap.publish()

    def __call__(self, a: torch.Tensor, b: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
        h = self.heap
        _check_operands("gemm_rs", a, b, h.device)
        W = h.world_size
        m, k = a.shape
        n = b.shape[1]
        if m % W:
            a = torch.cat([a, a.new_zeros((W - m % W, k))])
        rows = a.shape[0] // W
        cfg = config or pick_config(rows, n, k, h.device)
        tiles = -(-rows // cfg.block_m) * -(-n // cfg.block_n)
        fits = rows <= self.max_rows and n == self.n and a.dtype == self.dtype and tiles <= self.max_tiles
        if rows == 0 or k == 0 or not fits or not _kernel_applies(a):
            stats.record("gemm_rs.fallback")
            return runtime.reduce_scatter(a @ b, self.device_group)
        stats.record("gemm_rs.kernel")
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        gemm_rs_kernel[(self.programs,)](
            a, b, c, self.recv, self.flags, self.epochs, rows, n, k, a.stride(0), b.stride(0), b.stride(1),
            self.max_tiles, h.rank, W, h.heap_bases, h.error, h.spin_limit, **cfg.launch_kwargs(k, h.device))
        h.check_if_free()
        return c
