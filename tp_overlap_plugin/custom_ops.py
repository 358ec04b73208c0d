"""Our all-reduce as a torch custom op, `torch.ops.tp_overlap.all_reduce(x, key)`.

torch.compile must not trace into the Triton launch or the heap's Python state, and a CUDA graph
must capture the kernel as one opaque node; a custom op with a fake (shape-only) implementation
gives both. The op cannot take a Python object, so the reducer is looked up by a string key that
an engine adapter registers once per process (vLLM's adapter uses the TP group's unique name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.ops.all_reduce import HeapAllReduce


@dataclass
class _Reducer:
    heap_all_reduce: HeapAllReduce
    # The engine's own all-reduce, for what the heap kernel does not cover. It may work in place;
    # the op hands it a private copy, so the op's input is never mutated.
    fallback: Callable[[torch.Tensor], torch.Tensor]
    bf16_via_fp32: bool
    # (message bytes, inside a CUDA graph capture, the message's rows: the step's tokens) -> use the heap
    # kernel; e.g. Dispatcher.ipc_all_reduce within the engine's verdict for the step size (vllm_plugin)
    choose: Callable[[int, bool, int], bool] | None


_reducers: dict[str, _Reducer] = {}


def register_all_reduce(key: str, heap_all_reduce: HeapAllReduce,
                        fallback: Callable[[torch.Tensor], torch.Tensor],
                        bf16_via_fp32: bool | None = None,
                        choose: Callable[[int, bool, int], bool] | None = None) -> None:
    """`bf16_via_fp32` (default: on the CPU) reduces bf16 messages as fp32 and rounds with torch.
    The Triton interpreter (Triton 3.9) truncates fp32 -> bf16 casts instead of rounding to nearest
    even as GPUs do, so the kernel's bf16 output would sit up to 1 ulp towards zero from every
    other all-reduce's; the fp32 sum itself is the same."""
    if key in _reducers and _reducers[key].heap_all_reduce is not heap_all_reduce:
        raise RuntimeError(f"an all-reduce is already registered under {key!r} in this process")
    if bf16_via_fp32 is None:
        bf16_via_fp32 = heap_all_reduce.heap.device.type == "cpu"
    _reducers[key] = _Reducer(heap_all_reduce, fallback, bf16_via_fp32, choose)
    watch_graphs(heap_all_reduce.heap)


def registered(key: str) -> bool:
    return key in _reducers


# Heaps whose error word CUDA graphs carry to the host (watch_graphs), and whether torch's CUDAGraph is
# patched for it (once per process).
_watched: list = []
_graphs_patched = False


def watch_graphs(heap) -> None:
    """Surface a failed wait of `heap` under CUDA-graph replay, where the op's Python does not run.

    Every graph captured in this process ends with a copy of the heap's error word into pinned host
    memory (a node after all of the step's kernels), and every replay first reads the word the last
    replay left there: host memory, no sync, no device time beyond one 8-byte copy per graph. An
    engine waits for a step's tokens (its own sync, after the copy in stream order) before it runs
    the next step, so a step whose wait gave up raises RankTimeoutError at the next replay at the
    latest: within one step. (vLLM's adapter: vLLM captures and replays through torch.cuda.CUDAGraph.)"""
    global _graphs_patched
    if heap.device.type != "cuda" or heap in _watched:
        return
    heap.queue_error_copy()  # allocates the pinned word outside any capture
    _watched.append(heap)
    if _graphs_patched:
        return
    graph_cls = torch.cuda.CUDAGraph
    capture_end, replay = graph_cls.capture_end, graph_cls.replay

    def capture_end_with_error_copy(self, *args, **kwargs):
        for h in _watched:
            h.queue_error_copy()
        return capture_end(self, *args, **kwargs)

    def replay_after_check(self, *args, **kwargs):
        for h in _watched:
            h.raise_if_seen()
        return replay(self, *args, **kwargs)

    graph_cls.capture_end = capture_end_with_error_copy
    graph_cls.replay = replay_after_check
    _graphs_patched = True


@torch.library.custom_op("tp_overlap::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, key: str) -> torch.Tensor:
    reducer = _reducers.get(key)
    if reducer is None:
        raise RuntimeError(f"tp_overlap::all_reduce: nothing registered under {key!r} in this process "
                           f"(registered: {sorted(_reducers)})")
    in_graph = runtime.capturing(x.device)
    if not in_graph:
        # The engine adapters (vLLM's) have no sync point at which to check the heap's error slot:
        # a non-blocking poll on every eager call surfaces a peer that stopped answering.
        reducer.heap_all_reduce.heap.poll()
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 1
    if reducer.choose is not None and not reducer.choose(x.numel() * x.element_size(), in_graph, rows):
        stats.record("custom_op.all_reduce.fallback.dispatch")
    elif reducer.bf16_via_fp32 and x.dtype == torch.bfloat16:
        wide = x.float()
        if reducer.heap_all_reduce.kernel_applies(wide):
            stats.record("custom_op.all_reduce.heap")
            stats.record("custom_op.all_reduce.bf16_via_fp32")
            return reducer.heap_all_reduce(wide).to(torch.bfloat16)
        stats.record("custom_op.all_reduce.fallback.uncovered")
    elif reducer.heap_all_reduce.kernel_applies(x):
        stats.record("custom_op.all_reduce.heap")
        return reducer.heap_all_reduce(x)
    else:
        stats.record("custom_op.all_reduce.fallback.uncovered")
    stats.record("custom_op.all_reduce.fallback")
    out = reducer.fallback(x.clone())
    return out if out.is_contiguous() else out.contiguous()


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
