"""Tile configs of the GEMM core (kernels/gemm.py) and where they come from.

`pick_config(rows, n, k, device)` reads the table measured on the device (`tp-overlap tune`'s cached
one, else the shipped `tp_overlap_plugin/gemm_tables/<device>.json`, in tables.find's order; both are
made by tp_overlap_plugin/tuning/gemm_configs.py): per M bucket and
(N, K) the fastest measured config. Shapes the table lacks take the bucket's most frequent winner;
devices without a table take the constants below (CDNA3's are on paper). Deterministic in the shape
and device, so every rank tiles alike; nothing is autotuned at run time.

`prefers_cublas(m, n, k, device)`: whether, at this M, our core trails cuBLAS by more than the
table's margin (the measured crossover), so a caller with the choice should run torch.matmul.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from tp_overlap_plugin import tables

@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False       # fuse the tile and K loops (see gemm_kernel); ignored by the interpreter
    persistent: bool = True     # False: one program per tile, the hardware schedules them
    tma: bool = False           # operands through tensor descriptors (when aligned; else pointers)
    device_desc: bool = False   # descriptors built in the kernel (warp specialization needs them)
    c_tma: bool = False         # C through a descriptor too (never for a peer's heap)
    subtile: bool = False       # store C in two column halves
    warp_spec: bool = False     # producer/consumer warp groups (Hopper: num_warps=4, not flattened)
    split_k: int = 1            # K slices per tile; 0: as many as fill the SMs when tiles are few

    def label(self) -> str:
        """Short stable name (bench tables, results JSON)."""
        kind = ("dtma" if self.device_desc else "tma") if self.tma else "ptr"
        s = f"{kind} {self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} " \
            f"w{self.num_warps} s{self.num_stages}"
        for flag, tag in ((self.flatten, "flat"), (not self.persistent, "grid"), (self.c_tma, "ctma"),
                          (self.subtile, "sub"), (self.warp_spec, "ws")):
            s += f" {tag}" if flag else ""
        if self.split_k != 1:
            s += " splitk" if self.split_k == 0 else f" split{self.split_k}"
        return s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# Devices without a measured table. Hopper: v2's sweep winner (pointer path) for large M.
# CDNA3 (MI300X), on paper: no TMA; 256x256 tiles with 2 stages fit its 64 KB LDS and feed its
# larger matrix cores; small M splits K, as its 304 CUs starve sooner than Hopper's 132 SMs.
HOPPER_LARGE = TileConfig(128, 256, 64, 16, 8, 3, flatten=True)
HOPPER_SMALL_M = TileConfig(64, 128, 64, 8, 4, 4)
CDNA3_LARGE = TileConfig(256, 256, 64, 4, 8, 2)
CDNA3_SMALL_M = TileConfig(64, 128, 64, 4, 4, 2, split_k=0)
INTERPRETER = TileConfig(32, 32, 32, 4, 4, 1)
SMALL_M = 64  # at or below: the small-M constants


# the table's type, its configs TileConfig (tables.GEMM parses it)
GemmTable = tables.GemmTable


def parse_table(data: dict) -> GemmTable:
    """A GEMM config table's JSON as pick_config reads it."""
    return tables.GEMM.parse(data, TileConfig.from_dict)


@functools.lru_cache(maxsize=None)
def find_table(device_name: str) -> tuple[GemmTable | None, "tables.Found"]:
    """The table for this device (cache, then shipped) and where it came from; its warnings are
    logged here, once per process. A table that does not parse falls back like a missing one."""
    return tables.load_config_table("gemm", device_name, TileConfig.from_dict,
                                    "the GEMM core takes its on-paper configs")


def load_table(device_name: str) -> GemmTable | None:
    return find_table(device_name)[0]


def table_source(device: torch.device) -> str:
    """For the start-up log: which GEMM config table this device's kernels tile by."""
    if device.type == "cpu":
        return "the interpreter's fixed tiles"
    return find_table(_device_name(device))[1].describe()


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def device_table(device: torch.device) -> GemmTable | None:
    if device.type == "cpu":
        return None
    return load_table(_device_name(device))


def pick_config(rows: int, n: int, k: int, device: torch.device) -> TileConfig:
    """Tiles for a GEMM of `rows` rows (the fused ops call it per shard)."""
    if device.type == "cpu":
        return INTERPRETER
    table = device_table(device)
    cfg = table.config(rows, n, k) if table is not None else None
    if cfg is not None:
        return cfg
    small = rows <= SMALL_M
    if torch.version.hip is not None:
        return CDNA3_SMALL_M if small else CDNA3_LARGE
    return HOPPER_SMALL_M if small else HOPPER_LARGE


def prefers_cublas(m: int, n: int, k: int, device: torch.device) -> bool:
    """True where our core trails cuBLAS by more than the table's margin at this M (below the
    measured crossover), and on devices with no table (unmeasured: stock, like the dispatcher)."""
    table = device_table(device)
    return True if table is None else table.prefers_cublas(m, n, k)


GEMM_AR_BLOCK_N = (128, 64, 32, 16)


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, looked up per call
def gemm_all_reduce_config(m: int, n: int, programs: int, device: torch.device) -> TileConfig:
    """Tiles for GEMM + all-reduce at decode sizes (kernels/gemm_ar.py), on paper until measured:
    the GEMM streams the weight once, so the tiles are as narrow in N as it takes for every SM to
    stream a share (the fewest weight columns for the busiest program; of equals, the wider tile),
    and as tall as M (tl.dot's 16 rows at least). K blocks of 256 at 16 rows, 128 above, 4 stages:
    about 100 KB of shared memory in flight per SM, what a weight stream at HBM speed needs on Hopper.
    CDNA3's 64 KB LDS takes 2 stages."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if device.type == "cpu":  # the interpreter: small tiles, so tests have several of them
        return TileConfig(block_m, 16, 32, 4, 4, 1)
    tiles_m = -(-m // block_m)

    def busiest(bn: int) -> int:
        return -(-(tiles_m * -(-n // bn)) // programs) * bn
    block_n = min(GEMM_AR_BLOCK_N, key=lambda bn: (busiest(bn), -bn))
    block_k = 256 if block_m <= 16 else 128
    if torch.version.hip is not None:
        return TileConfig(block_m, block_n, 128, 4, 4, 2)
    return TileConfig(block_m, block_n, block_k, 4, 4, 4)
