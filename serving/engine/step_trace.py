"""A record of every engine step, for the step timeline under load (bench/serve_timeline.py).

Off unless the environment names a file: `TP_OVERLAP_STEP_TRACE=/path/steps.jsonl` (rank 0 writes
it, one JSON object a line). Off, the engine holds None and pays one `is None` test per step.

Per step: its kind (prefill: no decode token; decode: only decode tokens; mixed: both), tokens,
sequences, decodes, whether it replayed a CUDA graph, the host's times (scheduling, building the
inputs, launching the forward and sampling) and, on a GPU, three events on the stream:

    enter ── recorded when the host starts the step (it fires once the GPU has finished all earlier
             work, or at once when the GPU is idle)
    start ── recorded just before the step's first device work
    end   ── recorded after the step's sampled ids are queued for the host

`exposed_ms` = enter → start: how long the GPU had nothing to run because the host was still
scheduling and building this step (0 when the host was ahead). `gpu_ms` = start → end: the GPU's span
of the step, launch bubbles inside it included (a step whose `launch_ms` is close to its `gpu_ms`
was bound by the host's launches). Times are read once the events have fired, never waited for.
`paths` counts which path each TP op took in the step (tp_overlap_plugin.stats), when any did.
`compiles` names every Triton kernel variant the step had to build or load (Triton's JIT cache hook):
mid-serving each one is a stall of 0.1-2 s, and the name carries the specialisation (an int argument
specialised as divisible by 16 or equal to 1, a pointer's alignment) that was new.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Optional

import torch

from tp_overlap_plugin import options, stats

ENV = options.STEP_TRACE_ENV   # the variable's name, for those that set it (tests, bench/serve_timeline.py)


def step_kind(num_decodes: int, num_seqs: int) -> str:
    if num_decodes == 0:
        return "prefill"
    return "decode" if num_decodes == num_seqs else "mixed"


class StepTrace:
    FLUSH_EVERY = 256   # records per write, or FLUSH_S seconds: the file is not touched on most steps
    FLUSH_S = 2.0

    def __init__(self, path: str, device: torch.device):
        self.path = path
        self.cuda = device.type == "cuda"
        self.file = open(path, "a", buffering=1 << 16)
        self.open: deque = deque()    # records whose events may not have fired yet
        self.done: list = []
        self.count = 0
        self.flushed = time.monotonic()
        self._enter = None
        self.compiles: list = []
        _watch_compiles(self.compiles)

    @classmethod
    def from_env(cls, device: torch.device) -> Optional["StepTrace"]:
        path = options.env_step_trace()
        return cls(path, device) if path else None

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def enter(self) -> None:
        """The host starts a step (scheduling first)."""
        self._enter = (time.time(), time.perf_counter(), self._event())

    def start(self, batch, t_scheduled: float) -> dict:
        """The step's inputs are built on the host; its device work comes next."""
        wall, t0, ev = self._enter or (time.time(), t_scheduled, None)
        n = len(batch.seqs)
        rec = {"step": self.count, "t": wall, "kind": step_kind(batch.num_decodes, n),
               "tokens": sum(batch.num_new), "seqs": n, "decodes": batch.num_decodes,
               "schedule_ms": (t_scheduled - t0) * 1e3, "build_ms": (time.perf_counter() - t_scheduled) * 1e3,
               "_t": time.perf_counter(), "_ev": (ev, self._event()), "_stats": stats.snapshot()}
        self.compiles.clear()   # built between steps (warm-up, capture): not this step's
        self.count += 1
        return rec

    def end(self, rec: dict, graph: bool) -> None:
        """The step's work is queued (forward, sampling, the copy of its ids to the host)."""
        rec["launch_ms"] = (time.perf_counter() - rec.pop("_t")) * 1e3
        rec["graph"] = graph
        paths = stats.since(rec.pop("_stats"))
        if paths:
            rec["paths"] = paths
        if self.compiles:
            rec["compiles"] = list(self.compiles)
            self.compiles.clear()
        enter, start = rec.pop("_ev")
        rec["_ev"] = (enter, start, self._event())
        self.open.append(rec)
        self._collect()

    def _collect(self, wait: bool = False) -> None:
        while self.open:
            rec = self.open[0]
            enter, start, end = rec["_ev"]
            if end is not None:
                if not wait and not end.query():
                    break
                end.synchronize()
                rec["exposed_ms"] = enter.elapsed_time(start) if enter is not None else None
                rec["gpu_ms"] = start.elapsed_time(end)
            del rec["_ev"]
            for k, v in rec.items():   # microseconds are plenty, and halve the file
                if isinstance(v, float):
                    rec[k] = round(v, 6 if k == "t" else 3)
            self.done.append(self.open.popleft())
        now = time.monotonic()
        if self.done and (wait or len(self.done) >= self.FLUSH_EVERY or now - self.flushed > self.FLUSH_S):
            self.flushed = now
            self.file.write("".join(json.dumps(r) + "\n" for r in self.done))
            self.file.flush()
            self.done = []

    def close(self) -> None:
        if self.file.closed:
            return
        self._collect(wait=True)
        self.file.close()


def _watch_compiles(sink: list) -> None:
    """Append the name and specialisation of every kernel variant Triton's JIT builds or loads from
    here on (its cache hook runs before each; Triton 3.4+), chaining any hook already set."""
    try:
        from triton import knobs
    except ImportError:
        return
    before = knobs.runtime.jit_cache_hook

    def hook(*, repr, **kw):
        sink.append(repr[:2000])
        return before(repr=repr, **kw) if before else False
    knobs.runtime.jit_cache_hook = hook


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
