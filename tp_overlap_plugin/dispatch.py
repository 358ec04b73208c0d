"""Which path runs an op: our overlapped kernel, our IPC all-reduce, GEMM + all-reduce in one kernel,
or the stock torch/NCCL op.

The choice comes from a table measured on the device: `tp-overlap tune` measures one on the user's
machine (tp_overlap_plugin/tuning/) and caches it; tables for the devices we measured ship in
`tp_overlap_plugin/dispatch_tables/`; tp_overlap_plugin/tables/ says which one is used (and its kinds.py
what a table holds: DISPATCH_SECTIONS). A shape the
table has no measurement for goes to the stock path: without a measurement we cannot claim "never
slower than stock".

Modes: "table" (default), "overlap" (always our kernels: tests, and for measuring new shapes),
"stock" (never).

Without any table for the device and world size, "table" means stock everywhere;
`startup_warnings()` says so, and names the model shapes a table lacks, for the engines to log.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Iterable

from tp_overlap_plugin import tables
from tp_overlap_plugin.options import DISPATCH_MODES
from tp_overlap_plugin.shapes import LAYER_OPS

# How a step of some size runs, by the engine's verdict (tune's engine phase), from the most cautious:
# every op stock; the table's per-op choices in the replicated layout; the table's layout and ops
STEP_RUNS = ("stock", "replicated", "flag")


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
    # {hidden, tokens, graph_winner, eager_winner}: "fused" (all-reduce + add + RMSNorm in one kernel) or
    # "unfused" (our all-reduce, then the add + norm kernel)
    norm_rows: list[dict] = field(default_factory=list)
    # {M, K, N, graph_winner, eager_winner, norm_graph_winner, norm_eager_winner}: "gemm_ar" or "stock"
    # (other columns, such as an older table's, are ignored)
    gemm_all_reduce_rows: list[dict] = field(default_factory=list)
    gemv_rows: list[dict] = field(default_factory=list)  # {M, K, N, winner}: "gemv" or "stock"
    # {M, K, N, winner}: "fused" (gate_up with SiLU-mul in our GEMM's epilogue) or "stock"; N = gate | up
    silu_mul_rows: list[dict] = field(default_factory=list)
    # the all-reduce's "auto": one-shot up to this many bytes, two-shot above (tune measures it per
    # device and world size; None: ops.all_reduce.DEFAULT_ONE_SHOT_BYTES)
    one_shot_max_bytes: int | None = None
    # {M, shapes, runs}: the engine's verdict per step size of a model (its linear ops: [op, K, N]);
    # runs in STEP_RUNS
    engine_rows: list[dict] = field(default_factory=list)
    # the AG-GEMM / GEMM-RS design the gemm rows and the verdict were measured with (tp_overlap.fused_ops)
    fused_ops: str = "kernel"
    source: str = "none"
    margin: float = 1.02  # a layout change must win by this much (the table's own margin when loaded)
    missing: str | None = None  # the table file that was looked for and not found
    warnings: list[str] = field(default_factory=list)  # from the lookup: stale, corrupt, other device
    _layouts: dict = field(default_factory=dict, repr=False, compare=False)  # ops -> per-M layout rows
    # every question's answer, asked again by every layer of every step: the table never changes, and
    # an eager step of the flag's layers otherwise spends ~10 us per row layer scanning it
    _answers: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, got {self.mode!r}")

    @classmethod
    def load(cls, mode: str = "table", device_name: str | None = None, world: int = 2,
             path: str | os.PathLike | None = None, model: str | None = None) -> "Dispatcher":
        """The table for this device and world size (explicit `path`, then the cache, then the shipped
        tables: tables.load); an empty one (everything stock) if none was measured for it, or it does not
        parse."""
        if mode != "table":
            return cls(mode=mode)
        device_name = device_name or "cpu"
        fields, found = tables.load("dispatch", device_name, "the flag runs stock", world=world, explicit=path,
                                    model=model, current=tables.versions("cpu" if device_name == "cpu" else "cuda"))
        if fields is None:
            looked = tables.cached_path("dispatch", device_name, world)
            return cls(mode=mode, source=f"no table ({looked} nor the shipped one): stock everywhere",
                       missing=looked.name, warnings=found.warnings)
        return cls(mode=mode, **fields, source=found.describe(), warnings=found.warnings)

    def for_design(self, fused_ops: str) -> "Dispatcher":
        """This dispatcher for an engine whose sequence-parallel layout runs the `fused_ops` design: the
        same, or, where the table measured the other design, one without its AG-GEMM / GEMM-RS rows and
        its verdict (both were timed on ops this engine does not run), so the layout stays replicated
        and the rest of the table (all-reduces, decode matmuls) still applies; with a warning that
        names the tune command that measures this design."""
        if fused_ops in ("auto", self.fused_ops):
            return self
        if self.mode != "table":  # no rows to leave out: the design the engine was told to run
            return dataclasses.replace(self, fused_ops=fused_ops)
        if not (self.gemm or self.engine_rows):  # nothing of the other design; the advice names this one
            return dataclasses.replace(self, fused_ops=fused_ops, _layouts={}, _answers={})
        warning = (f"the dispatch table measured the {self.fused_ops!r} fused ops, and this engine runs "
                   f"tp_overlap.fused_ops={fused_ops!r}: AG-GEMM / GEMM-RS and the engine's verdict are left out "
                   f"(replicated layout); `{tables.tune_command(None, None, fused_ops)}` measures them")
        return dataclasses.replace(self, gemm=[], engine_rows=[], fused_ops=fused_ops,
                                   warnings=[*self.warnings, warning], _layouts={}, _answers={})

    @property
    def may_use_kernels(self) -> bool:
        """False when every op is sure to take the stock path (mode "stock", or no measurement)."""
        if self.mode != "table":
            return self.mode == "overlap"
        return (any(r.get("winner") == "overlap" for r in self.gemm)
                or any("ipc" in (r.get("graph_winner"), r.get("eager_winner")) for r in self.all_reduce)
                or any(r.get(k) == "gemm_ar" for r in self.gemm_all_reduce_rows for k in _GEMM_AR_WINNERS)
                or any(r.get("winner") == "gemv" for r in self.gemv_rows)
                or any(r.get("winner") == "fused" for r in self.silu_mul_rows))

    def missing_table_warning(self, device_name: str, world: int, model: str | None = None) -> str | None:
        """The start-up warning for a flag that, for want of a table, changes nothing here."""
        if self.mode != "table" or self.missing is None:
            return None
        cached = tables.cache_dir() / "dispatch" / self.missing
        # (a cached table that exists but does not read was skipped with a warning of its own)
        where = (f"the cached {cached} does not read, and none is shipped" if cached.exists()
                 else f"no {self.missing} in the cache {cached.parent} nor shipped")
        return (f"tp_overlap: no dispatch table for {device_name} at TP={world} ({where}), so the flag runs "
                f"the stock path for every op on this device. Run "
                f"`{tables.tune_command(world, model)}` on this "
                f"machine to measure one; or set the tp_overlap option \"dispatch\": \"overlap\" to force our kernels.")

    def missing_shapes(self, ops: Iterable[tuple[str, int, int]], world: int) -> list[tuple[str, int, int]]:
        """Which of a model's local matmuls (layer, K, N), as one rank holds them, the table has no row
        for: they run stock. At TP=1 only the GEMV rows count (nothing to communicate); above, the
        fused-op rows (column layers: AG-GEMM, row layers: GEMM-RS) and the GEMV rows."""
        if self.mode != "table" or self.missing is not None:
            return []
        gemv = {(r["K"], r["N"]) for r in self.gemv_rows}
        fused = {(r["op"], r["K"], r["N"]) for r in self.gemm}
        lacking = []
        for layer, k, n in ops:
            op = LAYER_OPS.get(layer, "ag")   # (the LM head is column-parallel)
            has = (k, n) in gemv and (world == 1 or (op, k, n) in fused or layer == "lm_head")
            if not has:
                lacking.append((layer, k, n))
        return lacking

    def startup_warnings(self, device_name: str, world: int, ops: Iterable[tuple[str, int, int]] = (),
                         model: str | None = None) -> list[str]:
        """Every warning the start-up logs, each once: the lookup's (stale, corrupt, other device), no
        table at all, and the model's shapes the table lacks."""
        out = list(self.warnings)
        none = self.missing_table_warning(device_name, world, model)
        if none:
            out.append(none)
        lacking = self.missing_shapes(ops, world)
        if lacking:
            out.append(f"tp_overlap: the dispatch table ({self.source}) has no rows for this model's "
                       f"{', '.join(f'{layer} K={k} N={n}' for layer, k, n in lacking)}, so those layers run stock. "
                       f"Run `{tables.tune_command(world, model)}` to measure them.")
        return out

    @_remembered
    def step_runs(self, m: int, ops: tuple) -> str:
        """How a step of m tokens runs (STEP_RUNS) in a model whose linear ops, (op, K, N) as one rank
        holds them, are `ops` (all of them, or the row layers' where only those are ours: vLLM): by the
        engine's verdict rows of a model whose ops include these. Between measured step sizes the more
        cautious of the two either side; past the largest (or below the smallest), that one's. No rows
        for the model (its steps never checked end to end): "flag", the table's per-op choices."""
        if self.mode != "table":
            return "flag"
        want = set(ops)
        rows = [r for r in self.engine_rows if want <= {tuple(s) for s in r["shapes"]}]
        if not rows:
            return "flag"
        below = [r["M"] for r in rows if r["M"] <= m]
        above = [r["M"] for r in rows if r["M"] >= m]
        near = ({max(below)} if below else set()) | ({min(above)} if above else set())
        return min((r["runs"] for r in rows if r["M"] in near), key=STEP_RUNS.index)

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
    def fused_norm(self, hidden: int, tokens: int, in_graph: bool) -> bool:
        """True: a row layer whose all-reduce is ours and feeds the residual add + RMSNorm runs the three as
        one kernel (ops.all_reduce_norm); False: our all-reduce, then the add + norm kernel. By the table's
        rows of this hidden size (tune's all_reduce phase); unmeasured: False, the two kernels whose
        parts were each measured."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.norm_rows if r["hidden"] == hidden]
        return bool(rows) and _wins(rows, "tokens", tokens, "graph_winner" if in_graph else "eager_winner", "fused")

    @_remembered
    def gemm_all_reduce(self, m: int, k: int, n: int, in_graph: bool, into_norm: bool = False) -> bool:
        """True: a row-parallel layer of the replicated layout ([m, k] local input, n outputs) runs as
        one GEMM + all-reduce kernel; False: F.linear and then the all-reduce (fused with the residual
        add and RMSNorm where `into_norm`, the layer feeds a norm, and the table runs the fused kernel
        at this size: fused_norm). The table's rows compare the kernel (+ the add + norm kernel where
        into_norm) with the faster of the alternatives, NCCL's and ours, as `tp-overlap tune` measures
        them (phase gemm_ar): against F.linear + the fused all-reduce + norm where that is what would run,
        else against F.linear + the all-reduce alone, since the add + norm kernel after it costs the same
        on both sides. Unmeasured: False."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.gemm_all_reduce_rows if r["K"] == k and r["N"] == n]
        against_fused = into_norm and self.fused_norm(n, m, in_graph)
        key = ("norm_" if against_fused else "") + ("graph_winner" if in_graph else "eager_winner")
        return bool(rows) and _wins(rows, "M", m, key, "gemm_ar")

    @_remembered
    def gemv(self, m: int, k: int, n: int) -> bool:
        """True: a linear layer of this rank ([m, k] input, n outputs, a decode-sized m) runs as our
        GEMV (kernels/gemv.py); False: F.linear (cuBLAS). The table's rows compare the two in CUDA
        graphs per weight shape and M, as `tp-overlap tune` measures them (phase gemv). Unmeasured: False."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.gemv_rows if r["K"] == k and r["N"] == n]
        return bool(rows) and _wins(rows, "M", m, "winner", "gemv")

    @_remembered
    def gemm_silu_mul(self, m: int, k: int, n: int) -> bool:
        """True: gate_up_proj ([m, k] input, n = gate | up local columns) and its SiLU-mul run as one
        launch with the activation in the epilogue (ops.gemv.gemv_silu_mul at decode-sized m where the
        decode matmul takes its FMA path, else ops.gemm.gemm_silu_mul); False: the layer's matmul and
        then the SiLU-mul kernel. The table's rows compare the two as measured by `tp-overlap tune`
        (phase silu_mul, tuning/silu_mul.py). Unmeasured: False."""
        if self.mode != "table":
            return self.mode == "overlap"
        rows = [r for r in self.silu_mul_rows if r["K"] == k and r["N"] == n]
        return bool(rows) and _wins(rows, "M", m, "winner", "fused")


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
