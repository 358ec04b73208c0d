"""The engine's dead-peer check without a per-step device sync (serving/worker/error_watch.py ErrorWatch): the heap's
error word is copied behind each step and read where the host waits anyway. Run here on the CPU with
the lagged (GPU) logic forced on and a stand-in heap: a step whose kernels gave up raises
RankTimeoutError before any of its tokens is emitted (rank 0), and a rank that never waits on its
tokens (a worker) raises at most DEPTH steps later."""

import pytest
import torch

from tp_overlap_plugin.heap import RankTimeoutError
from tp_overlap_plugin.serving import EngineConfig, LLMEngine, SamplingParams
from tp_overlap_plugin.serving.worker.error_watch import ErrorWatch


class FakeHeap:
    def __init__(self):
        self.error = torch.zeros(8, dtype=torch.int64)

    def check(self):
        if int(self.error[0]):
            raise RankTimeoutError("rank 0 gave up waiting for rank 1 (stand-in)")


def test_a_worker_raises_within_depth_steps():
    heap = FakeHeap()
    watch = ErrorWatch(heap, lagged=True)
    for _ in range(7):
        watch.after_step()
    heap.error[0] = 1                 # a kernel of the next step gives up
    watch.after_step()
    raised_at = None
    for i in range(1, 2 * ErrorWatch.DEPTH):
        try:
            watch.after_step()
        except RankTimeoutError:
            raised_at = i
            break
    assert raised_at == ErrorWatch.DEPTH


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_emits_no_token(async_scheduling):
    eng = LLMEngine(EngineConfig(model="demo", max_model_len=64, max_num_seqs=4, num_kv_blocks=64,
                                 show_progress=False, async_scheduling=async_scheduling))
    try:
        heap = FakeHeap()
        eng.runner.errors = ErrorWatch(heap, lagged=True)
        fail_at = 6
        calls = []
        orig = eng.runner.errors.after_step

        def after_step():
            calls.append(1)
            if len(calls) == fail_at:
                heap.error[0] = 1
            return orig()

        eng.runner.errors.after_step = after_step
        eng.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        emitted = 0
        with pytest.raises(RuntimeError, match="model step failed: rank 0 gave up") as info:
            for _ in range(40):
                emitted += sum(len(o.delta_token_ids) for o in eng.step())
        assert isinstance(info.value.__cause__, RankTimeoutError)
        # step 1 is the prefill and samples the first token; steps 2..5 decode one each; step 6 failed
        assert emitted == fail_at - 1
        with pytest.raises(RuntimeError, match="failed earlier"):
            eng.step()
    finally:
        eng.shutdown()


class _NeverReady:
    def __init__(self):
        self.queries = 0

    def query(self):
        self.queries += 1
        return False


def test_a_step_stuck_in_a_collective_ends_at_the_bounded_wait_and_names_a_stopped_rank():
    # A stopped peer never joins a collective, where no heap wait can give up: the host's wait for
    # the step's event is bounded instead (the engine core's _wait_ready), and the error says who stopped.
    import multiprocessing as mp
    import os
    import signal
    import time
    import types

    from tp_overlap_plugin.serving.engine.core import EngineCore
    from tp_overlap_plugin.serving.worker.workers import Workers, stopped as _stopped
    peer = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)   # a worker rank's stand-in
    peer.start()
    try:
        os_kill = os.kill
        os_kill(peer.pid, signal.SIGSTOP)
        for _ in range(100):          # the stop is asynchronous
            if _stopped(peer.pid):
                break
            time.sleep(0.01)
        workers = types.SimpleNamespace(procs=[peer], errq=types.SimpleNamespace(empty=lambda: True))
        workers.errors = lambda: Workers.errors(workers)
        eng = types.SimpleNamespace(READY_POLL_S=1e-3, _broken=None, workers=workers, step_wait_bound_s=lambda: 0.2)
        ev = _NeverReady()
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"did not finish within 0.2 s.*rank 1 \(pid \d+\) is stopped"):
            EngineCore._wait_ready(eng, ev)
        assert 0.2 <= time.monotonic() - t < 5 and ev.queries > 5 and isinstance(eng._broken, TimeoutError)
        os_kill(peer.pid, signal.SIGCONT)
        assert not _stopped(peer.pid)   # a running peer is not reported as stopped
    finally:
        peer.kill()
        peer.join()
