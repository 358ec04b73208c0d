"""Which path runs an op: our overlapped kernel, our IPC all-reduce, GEMM + all-reduce in one kernel,
or the stock torch/NCCL op.

The choice comes from a table measured on the device (`bench/make_dispatch_table.py` turns a
`bench/overlap.py` + `bench/foundation.py` run, and optionally a `bench/gemm_ar.py` run, into one;
the tables ship in `tp_overlap_plugin/dispatch_tables/`). A shape the table has no measurement for goes to the stock
path: without a measurement we cannot claim "never slower than stock".

Modes: "table" (default), "overlap" (always our kernels: tests, and for measuring new shapes),
"stock" (never).

Tables ship for the devices we measured (H200 at TP=2). Anywhere else, MI300X included, "table"
means stock everywhere; `missing_table_warning()` says so, for the engines to log at start-up.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

MODES = ("table", "overlap", "stock")
TABLE_DIR = Path(__file__).with_name("dispatch_tables")


def _remembered(question):
    """A table question whose answer is kept per arguments (Dispatcher._answers)."""
    @functools.wraps(question)
    def ask(self, *args, **kwargs):
        key = (question.__name__, args, tuple(sorted(kwargs.items())))
        if key not in self._answers:
            self._answers[key] = question(self, *args, **kwargs)
        return self._answers[key]
    return ask


@dataclass
class Dispatcher:
    mode: str = "table"
    gemm: list[dict] = field(default_factory=list)        # {op, M, K, N, winner}
    all_reduce: list[dict] = field(default_factory=list)  # {bytes, graph_winner, eager_winner}
    # {M, K, N, graph_winner, eager_winner, norm_graph_winner, norm_eager_winner}: "gemm_ar" or "stock"
    gemm_all_reduce_rows: list[dict] = field(default_factory=list)
    gemv_rows: list[dict] = field(default_factory=list)  # {M, K, N, winner}: "gemv" or "stock"
    source: str = "none"
    margin: float = 1.02  # a layout change must win by this much (the table's own margin when loaded)
    missing: str | None = None  # the table file that was looked for and not found
    _layouts: dict = field(default_factory=dict, repr=False, compare=False)  # ops -> per-M layout rows
    # every question's answer, asked again by every layer of every step: the table never changes, and
    # an eager step of the flag's layers otherwise spends ~10 us per row layer scanning it
    _answers: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"dispatch mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def load(cls, mode: str = "table", device_name: str | None = None, world: int = 2,
             path: str | os.PathLike | None = None) -> "Dispatcher":
        """The table for this device and world size; an empty one (everything stock) if none was
        measured for it."""
        if mode != "table":
            return cls(mode=mode)
        path = Path(path) if path is not None else table_path(device_name or "cpu", world)
        if not path.exists():
            return cls(mode=mode, source=f"no table at {path}: stock everywhere", missing=str(path))
        data = json.loads(path.read_text())
        return cls(mode=mode, gemm=data.get("gemm", []), all_reduce=data.get("all_reduce", []),
                   gemm_all_reduce_rows=data.get("gemm_all_reduce", []), gemv_rows=data.get("gemv", []),
                   source=str(path),
                   margin=data.get("margin", cls.margin))

    @property
    def may_use_kernels(self) -> bool:
        """False when every op is sure to take the stock path (mode "stock", or no measurement)."""
        if self.mode != "table":
            return self.mode == "overlap"
        return (any(r.get("winner") == "overlap" for r in self.gemm)
                or any("ipc" in (r.get("graph_winner"), r.get("eager_winner")) for r in self.all_reduce)
                or any("gemm_ar" in (r.get(k) for k in _GEMM_AR_WINNERS) for r in self.gemm_all_reduce_rows)
                or any(r.get("winner") == "gemv" for r in self.gemv_rows))

    def missing_table_warning(self, device_name: str, world: int) -> str | None:
        """The start-up warning for a flag that, for want of a table, changes nothing here."""
        if self.mode != "table" or self.missing is None:
            return None
        runs = ("bench/gemv.py --tp 1 (a rank's local matmuls: the only ops at TP=1)" if world == 1 else
                f"bench/overlap.py and bench/foundation.py with --tp {world}")
        return (f"tp_overlap: no dispatch table for {device_name} at TP={world} ({self.missing} does not "
                f"exist), so the flag runs the stock path for every op on this device. To measure one, run "
                f"{runs} on this machine, then bench/make_dispatch_table.py on their results; or set the "
                f"tp_overlap option \"dispatch\": \"overlap\" to force our kernels.")

    @_remembered
    def fused_gemm(self, op: str, m: int, k: int, n: int) -> bool:
        """True: use AG-GEMM ("ag") / GEMM-RS ("rs"); False: the sequential NCCL + GEMM op."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.gemm if r["op"] == op and r["K"] == k and r["N"] == n]
        return bool(rows) and _wins(rows, "M", m, "winner", "overlap")

    def sequence_parallel(self, m: int, ops: Iterable[tuple[str, int, int]]) -> bool:
        """Shard the residual by tokens this step? `ops` are a layer's linear ops as (op, K, N).
        In the sharded layout each op runs fused where that wins and as the sequential NCCL + GEMM
        pair elsewhere (an all-gather plus a reduce-scatter cost what the stock all-reduce does), so
        the layout pays off when the layer's total beats the sequential total by the margin, at the
        measured M on both sides of m. Ops not measured at some M: that M does not count."""
        if self.mode != "table":
            return self.mode == "overlap"
        # sorted: every rank must sum in the same order to take the same decision (str hashes, and
        # with them set order, differ between processes)
        key = tuple(sorted(set(ops)))
        if key not in self._layouts:  # asked every step; the answer per measured M never changes
            self._layouts[key] = self._layout_rows(key)
        return _wins(self._layouts[key], "M", m, "layout", "sharded")

    def _layout_rows(self, ops: tuple) -> list[dict]:
        rows = []
        for M in sorted({r["M"] for r in self.gemm}):
            at = {(r["op"], r["K"], r["N"]): r for r in self.gemm if r["M"] == M}
            if not ops or any(op not in at for op in ops):
                continue
            seq = sum(at[op]["sequential_ms"] for op in ops)
            best = sum(at[op]["ours_ms"] if at[op]["winner"] == "overlap" else at[op]["sequential_ms"] for op in ops)
            rows.append({"M": M, "layout": "sharded" if seq >= self.margin * best else "replicated"})
        return rows

    @_remembered
    def ipc_all_reduce(self, nbytes: int, in_graph: bool) -> bool:
        if self.mode != "table":
            return self.mode == "overlap"
        return bool(self.all_reduce) and _wins(self.all_reduce, "bytes", nbytes,
                                               "graph_winner" if in_graph else "eager_winner", "ipc")

    @_remembered
    def gemm_all_reduce(self, m: int, k: int, n: int, in_graph: bool, into_norm: bool = False) -> bool:
        """True: a row-parallel layer of the replicated layout ([m, k] local input, n outputs) runs as
        one GEMM + all-reduce kernel; False: F.linear and then the all-reduce (fused with the residual
        add and RMSNorm where `into_norm`: the layer feeds a norm). The table's rows compare the
        kernel (+ the add + norm kernel where into_norm) with the faster of the alternatives, NCCL's
        and ours, as measured by bench/gemm_ar.py. Unmeasured: False."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.gemm_all_reduce_rows if r["K"] == k and r["N"] == n]
        key = ("norm_" if into_norm else "") + ("graph_winner" if in_graph else "eager_winner")
        return bool(rows) and _wins(rows, "M", m, key, "gemm_ar")

    @_remembered
    def gemv(self, m: int, k: int, n: int) -> bool:
        """True: a linear layer of this rank ([m, k] input, n outputs, a decode-sized m) runs as our
        GEMV (kernels/gemv.py); False: F.linear (cuBLAS). The table's rows compare the two in CUDA
        graphs per weight shape and M, as measured by bench/gemv.py. Unmeasured: False."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.gemv_rows if r["K"] == k and r["N"] == n]
        return bool(rows) and _wins(rows, "M", m, "winner", "gemv")


_GEMM_AR_WINNERS = ("graph_winner", "eager_winner", "norm_graph_winner", "norm_eager_winner")


def _wins(rows: list[dict], key: str, value: int, winner_key: str, ours: str) -> bool:
    """Ours wins at `value` if it won at the measured points on both sides of it, or, above the
    largest measured size, at that size (fixed costs only shrink in share as sizes grow). Between a
    win and a loss, or below the smallest measured size, we do not know: stock."""
    below = [r for r in rows if r[key] <= value]
    above = [r for r in rows if r[key] >= value]
    if not below:
        return False
    near = [max(below, key=lambda r: r[key])]
    if above:
        near.append(min(above, key=lambda r: r[key]))
    return all(r[winner_key] == ours for r in near)


def device_key(device_name: str) -> str:
    """The device part of a table's name: "NVIDIA H200" -> "h200", "AMD Instinct MI300X" -> "mi300x".
    A virtual function (SR-IOV "MI300X VF", as cloud VMs report it) is the same chip, so the same key."""
    words = [w for w in device_name.lower().split() if w not in ("nvidia", "amd", "instinct")]
    if len(words) > 1 and words[-1] == "vf":
        words.pop()
    return "-".join(words) or "unknown"


def table_path(device_name: str, world: int) -> Path:
    """Where the table for this device and world size lives (bench/make_dispatch_table.py writes it)."""
    return TABLE_DIR / f"{device_key(device_name)}-tp{world}.json"
