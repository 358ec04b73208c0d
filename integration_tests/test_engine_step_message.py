"""The step message (serving/worker/step_message.py StepMessage): a step survives packing into one int64 tensor and
the trip to another rank, including steps longer than the first buffer."""

import pytest

from tp_overlap_plugin.multirank import run_ranks
from tp_overlap_plugin.serving.worker.step_message import StepInput, StepMessage


def _step(n_seqs: int, ctx: int, bs: int = 16) -> StepInput:
    tables = [[(7 * i + j) % 997 for j in range(-(-(ctx + i) // bs))] for i in range(n_seqs)]
    return StepInput(input_ids=[i * 3 + 1 for i in range(n_seqs)], q_lens=[1] * n_seqs,
                     context_lens=[ctx + i for i in range(n_seqs)], block_tables=tables, num_decodes=n_seqs,
                     logit_rows=list(range(n_seqs)))


STEPS = [_step(1, 10), _step(3, 40),
         StepInput([5, 6, 7, 8], [3, 1], [3, 1], [[2], [3, 9]], 0, [2, 3]),
         _step(256, 640)]   # ~10k block ids: longer than one buffer


def test_encode_decode_round_trip():
    for s in STEPS:
        assert StepMessage.decode(StepMessage.encode(s)) == s
    assert StepMessage.decode(StepMessage.encode(None)) is None
    assert len(StepMessage.encode(STEPS[-1])) > StepMessage.CAPACITY


def _relay(ctx, steps):
    msgs = StepMessage(ctx.group, ctx.rank)
    if ctx.rank == 0:
        for s in steps:
            msgs.send(s)
        msgs.send(None)
        return None
    got = []
    while (s := msgs.recv()) is not None:
        got.append(s)
    return got


@pytest.mark.timeout(120)
def test_broadcast_to_workers_in_order():
    steps = STEPS * 3
    results = run_ranks(_relay, 3, (steps,), device="cpu", timeout=100)
    assert results[1] == steps and results[2] == steps
