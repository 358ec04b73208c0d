"""Host ops for the overlapped tensor-parallel matmuls: `gemm`, `AllGatherGemm`, `GemmReduceScatter`.

All three launch the one GEMM core (kernels/gemm.py), the fused ops once per row shard, so the
compiler sees a plain tile loop it can flatten and pipeline. Ranks synchronise per shard (flags in
the heap), never per tile. Tile shapes come from `pick_config`, a deterministic function of the
shape and device (measured, not autotuned per process, so runs are reproducible).
Cases a kernel does not cover (dtype, layout, capacity) fall back to the stock torch op, never to
a wrong answer; `stats` records which path ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.gemm_config import TileConfig, pick_config, prefers_cublas  # noqa: F401 (re-exported)
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.gemm import gemm_kernel
from tp_overlap_plugin.kernels.gemm_rs import reduce_kernel, signal_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM. The interpreter runs programs one after another;
    one program walks all tiles in order there."""
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
    # the fused ops slice A by rows and hand the slices to the core; B may be any view
    return a.dtype in KERNEL_DTYPES and a.is_contiguous()


@dataclass(frozen=True)
class _Wait:
    """gemm_kernel's prologue: wait until every flag in `flags` (in my heap, written by `peer`) reaches `value`.
    With no flags it only checks that this rank has not given up on a peer (see gemm_kernel)."""
    heap: SymmetricHeap
    flags: torch.Tensor
    value: int
    peer: int


def _describable(t: torch.Tensor) -> bool:
    """A tensor descriptor can cover t as a row-major 2-D array: unit inner stride, 16-byte aligned
    base and row stride, 16-bit elements."""
    return (t.dtype in KERNEL_DTYPES and t.shape[0] > 0 and t.shape[1] > 0 and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def _operand_descriptors(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig):
    """(a_desc, b_desc, b_kmajor), or None where the operands must go by pointer. B as an nn.Linear
    weight transposed (K contiguous) is described as the weight itself, [N, K]. With device_desc
    the kernel builds the descriptors from the pointers and strides: the tensors go as they are."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if not _describable(a):
        return None
    kmajor = b.stride(0) == 1 and _describable(b.t())
    if not kmajor and not _describable(b):
        return None
    if cfg.device_desc:
        return a, b, kmajor
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    if kmajor:
        return a_desc, TensorDescriptor(b.t(), [b.shape[1], b.shape[0]], [b.stride(1), 1],
                                        [cfg.block_n, cfg.block_k]), True
    return a_desc, TensorDescriptor(b, list(b.shape), [b.stride(0), 1], [cfg.block_k, cfg.block_n]), False


MIN_K_BLOCKS_PER_SLICE = 4  # shorter slices cannot fill a pipeline


def split_slices(cfg: TileConfig, tiles: int, k_blocks: int, programs: int) -> int:
    """K slices per tile for this launch. Auto (split_k=0) splits only when the tiles would leave at
    least half of the SMs idle, as far as the SMs fill; slice count rounded so none is empty."""
    if cfg.split_k == 1:
        return 1
    if cfg.split_k > 1:
        s = cfg.split_k
    elif tiles * 2 > programs:
        return 1
    else:
        s = min(programs // tiles, k_blocks // MIN_K_BLOCKS_PER_SLICE)
    s = max(1, min(s, k_blocks))
    per = -(-k_blocks // s)
    return -(-k_blocks // per)


# Split-K scratch per (device, stream): fp32 partials and per-tile arrival counters (zero between
# launches: the last arrival resets its counter). Outgrown buffers stay referenced, because a
# captured CUDA graph may still write them.
_SPLIT_SCRATCH: dict = {}
_RETIRED_SCRATCH: list = []


def _split_scratch(device: torch.device, cells: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    ws, counts = _SPLIT_SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < cells or counts.numel() < tiles:
        if ws is not None:
            _RETIRED_SCRATCH.append((ws, counts))
        ws = torch.empty(max(cells, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        counts = torch.zeros(max(tiles, 0 if counts is None else counts.numel()), dtype=torch.int32, device=device)
        _SPLIT_SCRATCH[key] = (ws, counts)
    return ws, counts


class _DescriptorScratch:
    """Triton's allocator for kernels that build tensor descriptors in device memory: a buffer per
    (device, stream), grown, never freed (a captured graph keeps its address). Installed only
    around our own launches, so a caller's allocator stays theirs."""

    def __init__(self):
        self.buffers: dict = {}
        self.retired: list = []

    def __call__(self, size: int, alignment: int, stream):
        dev = torch.device("cuda", torch.cuda.current_device())
        key = (dev, stream)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < size + alignment:
            if buf is not None:
                self.retired.append(buf)
            buf = self.buffers[key] = torch.empty(size + alignment, dtype=torch.int8, device=dev)
        return buf[(-buf.data_ptr()) % alignment:]


_DESCRIPTOR_SCRATCH = _DescriptorScratch()


@contextlib.contextmanager
def _descriptor_allocator(active: bool):
    if not active:
        yield
        return
    from triton.runtime import _allocation  # the ContextVar behind triton.set_allocator (3.6-3.9)
    token = _allocation._allocator.set(_DESCRIPTOR_SCRATCH)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _eager_config(cfg: TileConfig) -> TileConfig:
    """The fused ops' config: the table's tiles, with operands and C by pointer. A launch with
    tensor descriptors costs 40-60 us more host time than one without (72-130 against 35-65 us on
    H200, bench/results/gemm-launch-h200-2026-11-22), and the fused ops enqueue 2W or more launches
    per call eagerly, so descriptors made them host-bound (GEMM-RS o_proj at M = 8192: 0.60 ms
    against 0.30 ms with pointers, bench/results/overlap-tp2-h200x2-2026-11-22-v3core) for a kernel
    gain of at most ~5% on these shapes."""
    return dataclasses.replace(cfg, tma=False, c_tma=False, device_desc=False, warp_spec=False)


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: TileConfig, wait: _Wait | None = None) -> None:
    m, k = a.shape
    n = b.shape[1]
    dev = a.device
    interpret = dev.type == "cpu"
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_blocks = -(-k // cfg.block_k)
    programs = num_programs(dev)
    # Rows that a peer delivers are read with plain loads: the flag's acquire orders ordinary loads
    # after it, but nothing portable orders the tensor-copy engine's reads (another memory proxy).
    waits_for_rows = wait is not None and wait.flags.numel() > 0
    descs = _operand_descriptors(a, b, cfg) if cfg.tma and not waits_for_rows else None
    a_arg, b_arg, b_kmajor = descs if descs is not None else (a, b, False)
    c_desc = out
    c_tma = descs is not None and cfg.c_tma and _describable(out)
    device_desc = descs is not None and cfg.device_desc
    if c_tma and not device_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor
        c_desc = TensorDescriptor(out, list(out.shape), [out.stride(0), 1],
                                  [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    # not behind a wait: a program that gives up would leave its tiles' arrival counters behind
    slices = split_slices(cfg, tiles, k_blocks, programs) if wait is None else 1
    ws, counts = _split_scratch(dev, tiles * slices * cfg.block_m * cfg.block_n, tiles) if slices > 1 else (out, out)
    work = tiles * slices
    grid = (min(work, programs) if cfg.persistent else work,)
    if wait is None:  # the prologue's arguments are unused: any pointer and zeros
        comm = (out, 0, 0, 0, 0, out, out, 0)
    else:
        h = wait.heap
        comm = (wait.flags, wait.flags.numel(), wait.value, h.rank, wait.peer, h.heap_bases, h.error, h.spin_limit)
    # flattening and warp groups need a plain tile loop: not with split-K's counter and reduction
    plain = slices == 1 and not interpret
    warp_spec = cfg.warp_spec and plain and descs is not None
    with _descriptor_allocator(device_desc and not interpret):
        gemm_kernel[grid](a_arg, b_arg, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                          out.stride(0), out.stride(1), *comm, c_desc, ws, counts, slices,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                          EVEN_K=k % cfg.block_k == 0, INTERPRET=interpret,
                          FLATTEN=cfg.flatten and plain and not warp_spec, WAIT=wait is not None,
                          TMA=descs is not None, B_KMAJOR=b_kmajor, C_TMA=c_tma, SUBTILE=cfg.subtile,
                          WARP_SPEC=warp_spec, SPLIT=slices > 1, DEVICE_DESC=device_desc,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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
    _launch(a, b, out, config or pick_config(m, n, k, a.device))
    return out


class AllGatherGemm:
    """c = all_gather(a_shard) @ b, the gather hidden behind the GEMM.

    The copy engine pushes my shard into every peer's heap (chunk by chunk, each followed by its
    flag) while the SMs multiply my own rows; then one GEMM per peer shard, in the order the shards
    were pushed, each waiting in its prologue for that shard's flags. By then the shard has landed,
    so the waits are short and no SM ever moves data.

    Capacity is fixed at construction (heap space is symmetric): `max_rows` rows per shard, `k`
    columns. Not for CUDA-graph capture: the pushes' destinations and the epoch are chosen on the
    host (the dispatcher uses it for prefill-sized M, which runs eagerly)."""

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
        self.epoch = torch.zeros(1, dtype=torch.int64, device=heap.device)  # the value the copy engine writes
        self.calls = 0
        self.stream = torch.cuda.Stream(heap.device) if heap.device.type == "cuda" else None
        # Per buffer half, in push order (rank+1 first): my shard's slot and my flags in each peer's heap.
        peers = [(heap.rank + i) % W for i in range(1, W)]
        self._peer_views = [[(heap.peer_view(self.gathered[p, heap.rank], q), heap.peer_view(self.flags[heap.rank], q))
                             for q in peers] for p in range(2)]
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
        self.calls += 1
        parity = self.calls % 2
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        cfg = config or _eager_config(pick_config(rows, n, k, h.device))
        main = torch.cuda.current_stream(h.device) if self.stream is not None else None
        if self.stream is not None:
            # The pushes wait for what produced a_shard and for my previous call. That call's GEMMs
            # waited for every peer's previous push, which each peer issued only after its own
            # GEMMs of the call before, the last readers of the half I now overwrite in its heap.
            self.stream.wait_stream(main)
        # My own rows first, launched before the pushes are enqueued: the host's work for the
        # pushes (a few copies per peer) then overlaps the GPU's first GEMM instead of delaying it.
        _launch(a_shard, b, c[h.rank * rows:(h.rank + 1) * rows], cfg)
        self._push(a_shard, parity, return_gathered)
        for i in range(1, W):
            src = (h.rank - i) % W  # the peer that pushes to me i-th (each pushes to rank+1 first)
            _launch(self.gathered[parity, src, :rows], b, c[src * rows:(src + 1) * rows], cfg,
                    _Wait(h, self.flags[src], self.calls, src))
        if self.stream is not None:
            main.wait_stream(self.stream)
        h.check_if_free()
        if return_gathered:
            # A copy, on the caller's stream after the GEMMs that waited for every shard: the heap's
            # half is overwritten by peers' pushes two calls later, and nothing orders those pushes
            # after reads the caller makes of a view.
            a_full = torch.empty((W * rows, k), dtype=a_shard.dtype, device=h.device)
            a_full.view(W, rows, k).copy_(self.gathered[parity, :, :rows])
            return c, a_full
        return c

    def _push(self, a_shard: torch.Tensor, parity: int, include_self: bool) -> None:
        """Copy-engine pushes of my shard, chunk by chunk, each followed by its flag."""
        h = self.heap
        rows = a_shard.shape[0]
        step = -(-rows // self.chunks)
        if self.stream is not None:
            a_shard.record_stream(self.stream)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            # The value the copy engine pushes as my flags. The kernel leaves it at the previous call's
            # value once this rank has given up on a peer, so peers time out instead of taking a shard
            # from a rank that is no longer in step (peer == rank: my own memory, no translation).
            signal_kernel[(1,)](self.epoch, self.calls, h.rank, h.rank, h.heap_bases, h.error, num_warps=1)
            for dst, flags in self._peer_views[parity]:
                for c in range(self.chunks):
                    lo, hi = c * step, min((c + 1) * step, rows)
                    if lo < hi:
                        dst[lo:hi].copy_(a_shard[lo:hi], non_blocking=True)
                    flags[c:c + 1].copy_(self.epoch, non_blocking=True)
            if include_self:
                self.gathered[parity, h.rank, :rows].copy_(a_shard, non_blocking=True)


class GemmReduceScatter:
    """c_shard = reduce_scatter(a @ b): rank r gets rows [r*M/W, (r+1)*M/W) of the sum over ranks.

    Peers' rows first: one GEMM per peer, whose epilogue stores straight into that owner's heap
    (NVLink stores ride along with the compute), then a flag for it; my own rows next, into my
    own slot; a reduce kernel last sums the W partials in rank order once their flags are up
    (kernels/gemm_rs.py). M not divisible by W is padded with zero rows to the next multiple; the
    padding rows come back as zeros at the end of the last rank's shard. Capacity: `max_rows` rows
    per shard, `n` columns. Not for CUDA-graph capture (the receive half is host-chosen); decode
    steps use the all-reduce layout instead."""

    REDUCE_BLOCK = 2048

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None):
        if max_rows < 1 or n < 1:
            raise ValueError(f"GemmReduceScatter needs max_rows, n >= 1; got {max_rows}, {n}")
        self.heap, self.max_rows, self.n, self.dtype = heap, max_rows, n, dtype
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W = heap.world_size
        self.recv = heap.alloc((2, W, max_rows, n), dtype, name="gemm_rs.recv")
        self.flags = heap.alloc((W,), torch.int64, name="gemm_rs.flags")  # flags[src]: written by src only
        self.flags.zero_()
        self.calls = 0
        # my slot in each owner's heap, per buffer half, in the order I serve the owners (rank+1 first)
        owners = [(heap.rank + i) % W for i in range(1, W)]
        self._at_owner = [[(q, heap.peer_view(self.recv[p, heap.rank], q)) for q in owners] for p in range(2)]
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
        fits = rows <= self.max_rows and n == self.n and a.dtype == self.dtype
        if rows == 0 or k == 0 or not fits or not _kernel_applies(a):
            stats.record("gemm_rs.fallback")
            return runtime.reduce_scatter(a @ b, self.device_group)
        if runtime.capturing(h.device):
            raise RuntimeError("GemmReduceScatter cannot be captured in a CUDA graph (its receive buffer "
                               "half is host-chosen); use it eagerly")
        stats.record("gemm_rs.kernel")
        self.calls += 1
        parity = self.calls % 2
        slot = self.recv[parity]
        cfg = config or _eager_config(pick_config(rows, n, k, h.device))
        to_peer = dataclasses.replace(cfg, c_tma=False)  # a peer's heap is stored to by pointer
        # Peers' GEMMs and flags check the error slot first: once this rank has given up on a peer, its
        # stream no longer orders its stores into an owner's half after that owner's last read of it.
        gate = _Wait(h, self.flags[:0], 0, h.rank)
        for owner, mine_there in self._at_owner[parity]:
            _launch(a[owner * rows:(owner + 1) * rows], b, mine_there[:rows], to_peer, gate)
            signal_kernel[(1,)](self.flags[h.rank:h.rank + 1], self.calls, h.rank, owner, h.heap_bases, h.error,
                                num_warps=1)
        _launch(a[h.rank * rows:(h.rank + 1) * rows], b, slot[h.rank, :rows], cfg)
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        count = rows * n
        reduce_kernel[(-(-count // self.REDUCE_BLOCK),)](
            slot, c, self.flags, self.calls, count, self.max_rows * n, h.rank, W, h.heap_bases, h.error,
            h.spin_limit, BLOCK=self.REDUCE_BLOCK, num_warps=4)
        h.check_if_free()
        return c
