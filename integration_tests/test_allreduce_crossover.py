"""The all-reduce's "auto" crossover comes from the measured rows of this device and world size
(tuning/rules.one_shot_crossover), reaches the layers through the dispatch table, and no constant
decides it where a measurement exists."""

import json

from tp_overlap_plugin.ops.all_reduce import DEFAULT_ONE_SHOT_BYTES
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.tuning.rules import all_reduce_rows, one_shot_crossover


def _row(nbytes, one, two, nccl=20.0):
    r = {"bytes": nbytes, "ours_two_shot_graph_us": two, "nccl_graph_us": nccl, "ours_two_shot_eager_us": two,
         "nccl_eager_us": nccl}
    if one is not None:
        r.update({"ours_one_shot_graph_us": one, "ours_one_shot_eager_us": one})
    return r


# H200x4, 2026-11-26 (bench/results/foundation-tp4-h200x4-2026-11-26): the two-shot wins from 512 KB
W4 = [_row(8 << 10, 7.4, 8.0), _row(32 << 10, 6.6, 8.0), _row(128 << 10, 8.8, 9.9), _row(512 << 10, 11.1, 10.2),
      _row(2 << 20, 29.4, 16.4)]
# the shape of a W=2 run: the one-shot wins to the slots' capacity, and the size past it is two-shot
W2 = [_row(8 << 10, 3.8, 5.3), _row(512 << 10, 5.6, 6.7), _row(1 << 20, 8.0, 9.0), _row(2 << 20, 14.0, 12.0)]


def test_crossover_is_the_last_size_the_one_shot_wins_to():
    assert one_shot_crossover(W4) == 128 << 10
    assert one_shot_crossover(W2) == 1 << 20
    assert one_shot_crossover([_row(8 << 10, 9.0, 8.0)] + W4[1:]) == 0  # losing at the smallest: two-shot
    # a run that measured only the one-shot keeps the old constant
    assert one_shot_crossover([{"bytes": 8 << 10, "ours_one_shot_graph_us": 5.0}]) == DEFAULT_ONE_SHOT_BYTES
    # each row is judged as "auto" would run it (tune's store holds the rows by key)
    assert [r["algorithm"] for r in all_reduce_rows(dict(enumerate(W4)))] == ["one_shot"] * 3 + ["two_shot"] * 2


def test_dispatcher_carries_the_tables_crossover(tmp_path):
    table = {"device": "cpu", "world": 4, "date": "2026-11-26", "margin": 1.02, "one_shot_max_bytes": 128 << 10,
             "gemm": [], "all_reduce": all_reduce_rows(dict(enumerate(W4)))}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    d = Dispatcher.load("table", device_name="cpu", world=4, path=path)
    assert d.one_shot_max_bytes == 128 << 10, d.source
    assert Dispatcher().one_shot_max_bytes is None  # no table: the op's own default
