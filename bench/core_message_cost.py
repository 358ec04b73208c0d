"""Host cost of the engine-core message path (serving/engine/core_process.py) for one step of N running
requests, on this machine's CPU: building the deltas and pickling them in the core, the pipe, and
unpickling and rebuilding RequestOutputs in the server.

    python bench/core_message_cost.py --requests 128 --generated 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time

from tp_overlap_plugin.serving.config import SamplingParams
from tp_overlap_plugin.serving.engine.llm_engine import delta_of
from tp_overlap_plugin.serving.engine.messages import ProcessedRequest, StepOutputs
from tp_overlap_plugin.serving.engine.outputs import RequestStream
from tp_overlap_plugin.serving.scheduler import Sequence, Status

PROTO = pickle.HIGHEST_PROTOCOL
STATS = {"num_requests_running": 128, "num_requests_waiting": 72, "kv_cache_total_blocks": 16384,
         "kv_cache_free_blocks": 9000, "kv_cache_usage_perc": 0.45, "num_preemptions": 0,
         "prefix_cache_hit_blocks": 3, "tp_op_calls": {"gemm_rs.kernel": 123456, "ag_gemm.kernel": 123456}}


def _us(f, n: int = 300) -> float:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e6


def _sequences(n: int, generated: int, logprobs: bool) -> list[Sequence]:
    p = SamplingParams(max_tokens=10 * generated, logprobs=logprobs)
    out = []
    for i in range(n):
        s = Sequence(f"cmpl-{'a' * 32}-{i}", None, list(range(1000, 1256)), p)
        s.tokens += list(range(generated))
        s.text = "word " * generated
        s.status = Status.RUNNING
        if logprobs:
            s.logprobs = [-0.5] * generated
        out.append(s)
    return out


def _sender(conn, blob: bytes, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(blob)
    conn.close()


def pipe_us(size: int, n: int = 3000) -> float:
    """Per message, receiver side, pipelined: what the reader thread waits for a step's message."""
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_sender, args=(w, b"x" * size, n))
    p.start()
    w.close()
    r.recv_bytes()
    t = time.perf_counter()
    for _ in range(n - 1):
        r.recv_bytes()
    dt = (time.perf_counter() - t) / (n - 1) * 1e6
    p.join()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--generated", type=int, default=200, help="tokens each request has generated so far")
    a = ap.parse_args()
    print(f"| {a.requests} requests, {a.generated} tokens each | message bytes | core: deltas us | core: pickle us | "
          f"server: unpickle us | server: rebuild RequestOutputs us |")
    print("|---|---|---|---|---|---|")
    size = 0
    for logprobs in (False, True):
        seqs = _sequences(a.requests, a.generated, logprobs)
        deltas = [delta_of(s, " word", [s.tokens[-1]]) for s in seqs]
        msg = StepOutputs(deltas, [], STATS)
        blob = pickle.dumps(msg, PROTO)
        size = max(size, len(blob))
        streams = []
        for s in seqs:
            st = RequestStream(s.request_id, ProcessedRequest(None, s.prompt_ids, s.params))
            st.text, st.token_ids, st.logprobs = s.text, list(s.output_ids), list(s.logprobs)
            streams.append(st)
        print(f"| logprobs={logprobs} | {len(blob)} "
              f"| {_us(lambda: [delta_of(s, ' word', [s.tokens[-1]]) for s in seqs]):.0f} "
              f"| {_us(lambda: pickle.dumps(msg, PROTO)):.0f} "
              f"| {_us(lambda: pickle.loads(blob)):.0f} "
              f"| {_us(lambda: [st.output(d) for st, d in zip(streams, deltas)], n=30):.0f} |")
    print(f"\npipe, {size} B messages: {pipe_us(size):.1f} us each (receiver side, pipelined)")


if __name__ == "__main__":
    main()
