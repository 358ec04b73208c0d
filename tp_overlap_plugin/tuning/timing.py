"""Timers of the measurements: device events on every rank, CUDA-graph replays, interleaved repeats,
and wall clock on the CPU (where the interpreter runs the kernels: a smoke run, not a measurement)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def time_per_call_ms(fn, *, calls: int = 20, samples: int = 15, group=None) -> float:
    """Median over `samples` of (time for `calls` back-to-back calls) / calls. Ranks start each
    sample together (a host barrier over `group`), so one rank's late start does not read as latency.
    Without a group (single-GPU measurements, also on one rank of several) there is nobody to wait for."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def wall_ms(fn, *, calls: int = 1, group=None) -> float:
    """The CPU's timer: wall clock per call after a host barrier over `group` if given (no device
    events there)."""
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - t0) / calls


def hbm_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written: what a decode step that
    streams the weights once can hope for."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def cycle(items):
    """A function returning the next item on every call: each call captured into a graph gets its own
    (a weight copy per call, so the copies together overflow L2 as a model's layers do)."""
    state = [0]

    def nxt():
        state[0] = (state[0] + 1) % len(items)
        return items[state[0]]
    return nxt


def capture_graph(fn, calls: int, stream=None):
    """A CUDA graph of `calls` calls to fn; returns a replay function. fn must be warm. With `stream`
    (capture_stream), fn runs once more and the graph is captured on it; without, on a new stream
    and torch's capture stream."""
    warm = stream if stream is not None else torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()  # settle allocations on the capture stream
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph.replay


def capture_stream(device: torch.device):
    """One stream for every capture of a run (None on the CPU): our launch scratch (split-K partials,
    descriptor space) is cached per stream, so captures on one stream find it there."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def rotating_ms(fns: list, calls: int, *, stream=None, samples: int = 5) -> float:
    """Kernel time per call of `calls` calls going round `fns` (copies of one op on operands that
    together overflow L2): a CUDA graph captured on `stream`, the median of `samples` replays. Without
    a stream (the CPU, the interpreter) the wall clock of the calls, a smoke run."""
    nxt = cycle(fns)

    def call():
        nxt()()
    if stream is None:
        return wall_ms(call, calls=calls)
    for _ in fns:
        call()  # each copy once, on the default stream (capture_graph settles the capture stream's)
    replay = capture_graph(call, calls, stream)
    replay()
    torch.cuda.synchronize()
    return time_per_call_ms(replay, calls=1, samples=samples) / calls


def interleaved_ms(replays: dict, *, calls: int, rounds: int, samples: int, group=None) -> dict:
    """Per name, the median over `rounds` of a replay's time per call (ms; each replay runs `calls`
    calls). Within a round the replays run in turn, so drift on a shared machine hits them alike."""
    times = interleaved_rounds(replays, calls=calls, rounds=rounds, samples=samples, group=group)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_rounds(replays: dict, *, calls: int, rounds: int, samples: int, group=None) -> dict:
    """Per name, its time per call (ms) in each of `rounds` rounds, the replays taking turns within a
    round (the repeats a table's "wins by the margin in interleaved repeats" is judged on)."""
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(time_per_call_ms(replay, calls=1, samples=samples, group=group) / calls)
    return times


def graph_time_per_call_ms(fn, *, calls: int = 20, samples: int = 15, group=None) -> float:
    replay = capture_graph(fn, calls)
    replay()
    torch.cuda.synchronize()
    return time_per_call_ms(replay, calls=1, samples=samples, group=group) / calls


def repeats_us(ops: dict, *, gpu: bool, graph: bool, repeats: int, calls: int = 20, samples: int = 7,
               group=None, errors: dict | None = None) -> dict:
    """Per op name, `repeats` times per call in µs, the ops taking turns in each repeat: in CUDA
    graphs (`graph`) or eager on a GPU, by wall clock (one call) on the CPU. Every op must be warm.
    An op whose graph capture fails is left out, its error in `errors` (if given) or raised."""
    if not gpu:
        out = {name: [] for name in ops}
        for _ in range(repeats):
            for name, op in ops.items():
                out[name].append(1e3 * wall_ms(op, group=group))
        return out
    if not graph:
        out = {name: [] for name in ops}
        for _ in range(repeats):
            for name, op in ops.items():
                out[name].append(1e3 * time_per_call_ms(op, calls=calls, samples=samples, group=group))
        return out
    replays = {}
    for name, op in ops.items():
        try:
            replays[name] = capture_graph(op, calls)
            replays[name]()
        except Exception as e:  # keep the run going; the caller's row says why
            if errors is None:
                raise
            errors[name] = repr(e)[:200]
    torch.cuda.synchronize()
    rounds = interleaved_rounds(replays, calls=calls, rounds=repeats, samples=samples, group=group)
    return {name: [1e3 * t for t in ts] for name, ts in rounds.items()}


def record(row: dict, times: dict, mode: str) -> None:
    """Into a result row: per op `<op>_<mode>_us` (the median over repeats) and, with more than one
    repeat, `<op>_<mode>_us_repeats` (what the table's ratios and spreads are computed from)."""
    for name, ts in times.items():
        row[f"{name}_{mode}_us"] = statistics.median(ts)
        if len(ts) > 1:
            row[f"{name}_{mode}_us_repeats"] = ts
