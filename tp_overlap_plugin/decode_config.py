"""Configs of the decode matmul (`ops.gemv`, y = x @ W^T for 1..64 rows) and where they come from.

The decode matmul has two paths, one kernel family:
- "fma": kernels/gemv.py, each program streams whole weight rows and multiplies on the CUDA cores
  (the fastest stream at 1-4 rows, where an MMA tile would be mostly padding);
- "mma": the GEMM core (kernels/gemm.py) with the operands swapped, y^T = W @ x^T: the weight is
  the core's A, streamed in tiles of `block_n` weight rows (through tensor descriptors where
  `tma`), x^T is the core's B, one column tile of next_pow2(M) >= 16 rows; optional split-K with
  the core's deterministic slice-order sum.

`pick_decode_config(m, n, k, device)` reads the table measured on the device (`tp-overlap tune`'s
cached one, else the shipped `tp_overlap_plugin/decode_tables/<device>.json`, in tables.find's order;
both are made by tp_overlap_plugin/tuning/decode_configs.py): per M bucket and (N, K) the fastest
measured config; shapes the table lacks take the bucket's most
frequent winner; devices without a table take the constants below (CDNA3's on paper). A function
of (bucket, shape, device) alone, so every call and every rank runs the same kernel: same bits.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from tp_overlap_plugin import tables
from tp_overlap_plugin.gemm_config import TileConfig

PATHS = ("fma", "mma")
MAX_ROWS = 64        # the decode matmul's rows (x's M)
FMA_MAX_ROWS = 16    # the FMA path keeps one fp32 partial per row and vector slot: past 16 rows it spills
MMA_MIN_COLS = 16    # tl.dot's smallest side: x^T's tile is at least 16 columns


@dataclass(frozen=True)
class DecodeConfig:
    path: str             # "fma" | "mma"
    block_n: int          # weight rows per tile (fma: per program; mma: the core's BLOCK_M)
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False      # mma: operands through tensor descriptors (where aligned; else pointers)
    split_k: int = 1       # mma: K slices per tile (0: as many as fill the SMs when tiles are few)
    persistent: bool = False  # mma: one program per SM walking tiles, else one per tile

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"DecodeConfig.path must be one of {PATHS}, got {self.path!r}")

    def label(self) -> str:
        """Short stable name (bench tables, results JSON)."""
        if self.path == "fma":
            return f"fma {self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
        s = f"mma {'tma' if self.tma else 'ptr'} {self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
        if self.split_k != 1:
            s += " splitk" if self.split_k == 0 else f" split{self.split_k}"
        return s + (" pers" if self.persistent else "")

    def takes(self, m: int) -> bool:
        return 1 <= m <= (FMA_MAX_ROWS if self.path == "fma" else MAX_ROWS)

    def tile_config(self, m: int) -> TileConfig:
        """The GEMM core's tiles for the swapped product W @ x^T of m rows of x."""
        cols = max(MMA_MIN_COLS, 1 << (m - 1).bit_length())
        return TileConfig(self.block_n, cols, self.block_k, group_m=1, num_warps=self.num_warps,
                          num_stages=self.num_stages, persistent=self.persistent, tma=self.tma,
                          split_k=self.split_k)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# Devices without a measured table. Hopper: the GEMV's measured tile at 1-4 rows (bench/notes/gemm.md),
# above that the swapped core's most frequent winner of the first H200 sweep (bench/notes/decode.md):
# 64 weight rows a tile (one wgmma), K blocks of 128, 6 stages (96 KB of weight in flight per SM),
# split-K where tiles are few. CDNA3 (on paper): 64 KB of LDS takes 2 stages of 128-wide K.
HOPPER_FMA = DecodeConfig("fma", 16, 256, 4, 4)
HOPPER_MMA = DecodeConfig("mma", 64, 128, 4, 6, tma=True, split_k=0)
CDNA3_FMA = DecodeConfig("fma", 16, 256, 4, 2)
CDNA3_MMA = DecodeConfig("mma", 32, 128, 4, 2, split_k=0)
# the interpreter: small tiles, so tests cover several tiles, K blocks and a K tail
INTERPRETER_FMA = DecodeConfig("fma", 16, 32, 4, 1)
INTERPRETER_MMA = DecodeConfig("mma", 16, 32, 4, 1)
FMA_UPTO = 4  # rows at or below which a device without a table takes the FMA path




@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> tables.BucketedTable[DecodeConfig] | None:
    """The table for this device (cache, then shipped: tables.load_config_table); one that does not
    parse falls back like a missing one (the constants below)."""
    return tables.load_config_table("decode", device_name, DecodeConfig.from_dict,
                                    "the decode matmul takes its on-paper configs")[0]


def pick_decode_config(m: int, n: int, k: int, device: torch.device) -> DecodeConfig:
    """The config for x [m, k] @ W[n, k]^T on this device (see the module docstring)."""
    small = m <= FMA_UPTO
    if device.type == "cpu":
        return INTERPRETER_FMA if small else INTERPRETER_MMA
    from tp_overlap_plugin.gemm_config import _device_name
    table = load_table(_device_name(device))
    cfg = table.config(m, n, k) if table is not None else None
    if cfg is not None and cfg.takes(m):   # (a bucket's config may be one path's that cannot take m rows)
        return cfg
    if torch.version.hip is not None:
        return CDNA3_FMA if small else CDNA3_MMA
    return HOPPER_FMA if small else HOPPER_MMA
