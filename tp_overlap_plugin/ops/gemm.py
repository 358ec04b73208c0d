"""The GEMM core's host side: `gemm` (C = A @ B) and `gemm_silu_mul` (gate_up_proj with its activation
in the epilogue), both one persistent launch of kernels/gemm.py, and `launch_tiles`, which every user of
the core's plain tiles calls (gemv's tensor-core path too). Tile shapes come from `pick_config`, a
deterministic function of the shape and device (measured, not autotuned per process, so runs are
reproducible and every rank tiles alike). Operands go as TMA descriptors where the config says so and
they qualify, else by pointer; split-K where the tiles would leave most SMs idle."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tp_overlap_plugin.gemm_config import TileConfig, pick_config
from tp_overlap_plugin.kernels import triton_compat
from tp_overlap_plugin.kernels.gemm import gemm_kernel
from tp_overlap_plugin.ops.device import num_programs
from tp_overlap_plugin.ops.operands import KERNEL_DTYPES, check_operands


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
    with triton_compat.allocator(_DESCRIPTOR_SCRATCH):
        yield


def silu_mul_config(cfg: TileConfig) -> TileConfig:
    """What gemm_silu_mul runs for the plain GEMM's config `cfg`. The table's tile spans block_n
    columns of B: half of them gate, half up, for block_n / 2 columns of C. Split-K would activate
    partial sums. Flattened, ptxas serializes the two accumulators' wgmmas (its warning C7515, with
    Triton 3.6 and 3.9: the per-tile reset of both accumulators sits inside the MMA pipeline),
    which cost the fused kernel ~25% on H100 (bench/notes/gemm.md); unflattened they stay
    asynchronous. Warp-specialized, it left outputs unwritten on H100 (Triton 3.6): not used."""
    return dataclasses.replace(cfg, block_n=cfg.block_n // 2, split_k=1, flatten=False, warp_spec=False)


def launch_tiles(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: TileConfig, silu_mul: bool = False) -> None:
    m, k = a.shape
    n = out.shape[1]
    if silu_mul:
        cfg = silu_mul_config(cfg)
    dev = a.device
    interpret = dev.type == "cpu"
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_blocks = -(-k // cfg.block_k)
    programs = num_programs(dev)
    descs = _operand_descriptors(a, b, cfg) if cfg.tma else None
    a_arg, b_arg, b_kmajor = descs if descs is not None else (a, b, False)
    c_desc = out
    c_tma = descs is not None and cfg.c_tma and _describable(out)
    device_desc = descs is not None and cfg.device_desc
    if c_tma and not device_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor
        c_desc = TensorDescriptor(out, list(out.shape), [out.stride(0), 1],
                                  [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    slices = split_slices(cfg, tiles, k_blocks, programs)
    ws, counts = _split_scratch(dev, tiles * slices * cfg.block_m * cfg.block_n, tiles) if slices > 1 else (out, out)
    work = tiles * slices
    grid = (min(work, programs) if cfg.persistent else work,)
    # flattening and warp groups need a plain tile loop: not with split-K's counter and reduction
    plain = slices == 1 and not interpret
    warp_spec = cfg.warp_spec and plain and descs is not None
    with _descriptor_allocator(device_desc and not interpret):
        gemm_kernel[grid](a_ptr=a_arg, b_ptr=b_arg, c_ptr=out, M=m, N=n, K=k, stride_am=a.stride(0),
                          stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=out.stride(0),
                          stride_cn=out.stride(1), c_desc=c_desc, split_ws_ptr=ws, split_count_ptr=counts,
                          split_k=slices, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          GROUP_M=cfg.group_m,
                          EVEN_K=k % cfg.block_k == 0, INTERPRET=interpret,
                          FLATTEN=cfg.flatten and plain and not warp_spec,
                          TMA=descs is not None, B_KMAJOR=b_kmajor, C_TMA=c_tma, SUBTILE=cfg.subtile,
                          WARP_SPEC=warp_spec, SPLIT=slices > 1, DEVICE_DESC=device_desc, SILU_MUL=silu_mul,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
         config: TileConfig | None = None) -> torch.Tensor:
    """C = A @ B with our persistent Triton GEMM (the core the fused ops share)."""
    check_operands("gemm", a, b, a.device)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or a.dtype not in KERNEL_DTYPES + (torch.float32,):
        return torch.matmul(a, b, out=out)
    launch_tiles(a, b, out, config or pick_config(m, n, k, a.device))
    return out


def gemm_silu_mul_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The fused gate_up + SiLU-mul's cases: 16-bit floats alike on one device, A [M, K] contiguous,
    B [K, 2n] (gate | up) of any strides, 2n even and K > 0."""
    return (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and a.shape[1] > 0 and b.shape[1] % 2 == 0
            and b.shape[1] > 0 and a.dtype in KERNEL_DTYPES and b.dtype == a.dtype and a.is_contiguous()
            and a.device == b.device)


def gemm_silu_mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                  config: TileConfig | None = None) -> torch.Tensor:
    """silu(A @ B[:, :n]) * (A @ B[:, n:]) with B = [K, 2n] (gate | up: gate_up_proj's weight, transposed)
    in one launch of the GEMM core, the activation in its epilogue: the [M, 2n] product is never
    written. `config`: the plain GEMM's tiles for [M, K] x [K, 2n] (default: the table's); run
    without split-K, flattening or warp groups (silu_mul_config says why). fp32 sums, activated, rounded once."""
    if not gemm_silu_mul_applies(a, b):
        raise ValueError(f"gemm_silu_mul: takes a contiguous A [M, K] and B [K, 2n] (gate | up), K > 0, both of one "
                         f"16-bit dtype ({', '.join(map(str, KERNEL_DTYPES))}) on one device; got a{tuple(a.shape)} "
                         f"{a.dtype} {a.device} contiguous={a.is_contiguous()}, b{tuple(b.shape)} {b.dtype} {b.device}")
    m, k = a.shape
    n = b.shape[1] // 2
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"gemm_silu_mul: out must be [{m}, {n}] {a.dtype} on {a.device}, got {tuple(out.shape)} "
                         f"{out.dtype} {out.device}")
    if m:
        launch_tiles(a, b, out, config or pick_config(m, 2 * n, k, a.device), silu_mul=True)
    return out
