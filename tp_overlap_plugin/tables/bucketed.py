"""The shape the GEMM and decode config tables share: per measured M bucket and (N, K) shape the fastest
config, per bucket the most frequent winner; the GEMM's adds the cuBLAS crossover. The configs are
the readers' own dataclasses (gemm_config.TileConfig, decode_config.DecodeConfig), made by the `make`
they pass to the kind's parse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

C = TypeVar("C")
# the fields of a bucketed table's JSON (tuning writes them; extra fields are the kind's own)
BUCKETED_FIELDS = ("buckets", "configs", "entries", "defaults")


@dataclass(frozen=True)
class BucketedTable(Generic[C]):
    """Configs measured per M bucket and (N, K) shape: the GEMM core's tiles (gemm_config.py) and the
    decode matmul's (decode_config.py). In JSON: `buckets` (measured M, ascending), `configs` (label ->
    config fields), `entries` ({M, N, K, label}: the fastest at that shape), `defaults` (bucket -> the
    label of its most frequent winner, for shapes the table lacks)."""
    buckets: tuple[int, ...]
    configs: dict       # (bucket, n, k) -> C
    defaults: dict      # bucket -> C

    @staticmethod
    def fields_of(data: dict, make: Callable[[dict], C]) -> dict:
        """The constructor's fields from the JSON, each config made by `make` from its fields."""
        by_label = {label: make(c) for label, c in data["configs"].items()}
        return {"buckets": tuple(data["buckets"]),
                "configs": {(e["M"], e["N"], e["K"]): by_label[e["label"]] for e in data["entries"]},
                "defaults": {int(m): by_label[label] for m, label in data["defaults"].items()}}

    @classmethod
    def parse(cls, data: dict, make: Callable[[dict], C]) -> "BucketedTable[C]":
        return cls(**cls.fields_of(data, make))

    def bucket(self, m: int) -> int:
        """The smallest measured M >= m (its tiles cover m rows), or the largest."""
        return next((b for b in self.buckets if b >= m), self.buckets[-1])

    def config(self, m: int, n: int, k: int) -> C | None:
        b = self.bucket(m)
        return self.configs.get((b, n, k), self.defaults.get(b))


@dataclass(frozen=True)
class GemmTable(BucketedTable[C]):
    """The GEMM core's bucketed tiles, and per (N, K) the measured crossover below which cuBLAS wins."""
    cublas_below: dict                              # (n, k) -> M (None: cuBLAS at every measured M)
    default_cublas_below: int | None
    margin: float

    @classmethod
    def parse(cls, data: dict, make: Callable[[dict], C]) -> "GemmTable[C]":
        return cls(**cls.fields_of(data, make),
                   cublas_below={(e["N"], e["K"]): e["M"] for e in data["cublas_below"]},
                   default_cublas_below=data.get("default_cublas_below"), margin=data["margin"])

    def prefers_cublas(self, m: int, n: int, k: int) -> bool:
        below = self.cublas_below.get((n, k), self.default_cublas_below)
        return below is None or m < below
