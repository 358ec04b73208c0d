"""Operand checks the host ops share: what the matmul kernels take (KERNEL_DTYPES, contiguity, one
device), the fused matmuls' tile config, and memory-span tests for outputs that must not alias inputs.
A case a kernel does not take goes to the stock op, never to a wrong answer."""

from __future__ import annotations

import dataclasses

import torch

from tp_overlap_plugin.gemm_config import TileConfig, pick_config

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def check_operands(op: str, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: expected 2-D operands, got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a{tuple(a.shape)} @ b{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: dtypes differ: a is {a.dtype}, b is {b.dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def kernel_applies(a: torch.Tensor) -> bool:
    # the fused ops slice A by rows and hand the slices to the core; B may be any view
    return a.dtype in KERNEL_DTYPES and a.is_contiguous()


def eager_config(cfg: TileConfig) -> TileConfig:
    """The fused ops' config: the table's tiles, operands and C by pointer. Rows a peer delivers
    are read with ordinary loads, which the flag's acquire orders (nothing portable orders the
    tensor-copy engine's reads after it), and C may be a peer's heap. Descriptors would also cost
    40-60 us more host time per launch (bench/results/gemm-launch-h200-2026-11-22)."""
    return dataclasses.replace(cfg, tma=False, c_tma=False, device_desc=False, warp_spec=False)


def fused_config(rows: int, n: int, k: int, device: torch.device, config: TileConfig | None) -> TileConfig:
    return config or eager_config(pick_config(rows, n, k, device))


def span(t: torch.Tensor) -> tuple[int, int]:
    """Addresses from a tensor's first to one past its last element."""
    lo = t.data_ptr()
    return lo, lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def outputs_overlap(outs, ins) -> bool:
    """Whether the memory span of any non-empty tensor of `outs` intersects one of `ins`."""
    for o in outs:
        if o is None or o.numel() == 0:
            continue
        o0, o1 = span(o)
        for i in ins:
            i0, i1 = span(i)
            if o0 < i1 and i0 < o1:
                return True
    return False


def check_apart(op: str, outs: dict, ins: dict, why: str) -> None:
    """ValueError naming the first output of `outs` ({name: tensor or None}) whose memory overlaps an
    input of `ins`: `why` says what the kernel does that makes it wrong."""
    for name, t in outs.items():
        for src_name, src in ins.items():
            if t is not None and outputs_overlap((t,), (src,)):
                raise ValueError(f"{op} {name} overlaps {src_name}: {why}; pass separate tensors")


def like(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """A tensor of this shape, dtype and device with unit last stride (what the row kernels index)."""
    return t.shape == shape and t.dtype == dtype and t.device == device and t.stride(-1) == 1
