"""The host's reading of the heap's error slot. The slot's layout is the kernels' (kernels/error_slot.py:
they write it); SymmetricHeap allocates it, sets the wait bound in it and raises what a record says
(`heap.check`)."""

from __future__ import annotations

from typing import Callable

from tp_overlap_plugin.kernels.error_slot import (ERR_BOUND_NS, ERR_CODE, ERR_EXPECTED, ERR_FLAG_OFFSET, ERR_PEER,
                                                  ERR_RANK, ERR_SEEN)


def failure(record: list[int], timeout_s: float, describe_offset: Callable[[int], str]) -> str | None:
    """What a slot's words say: None while every wait succeeded, else which rank gave up on which peer's
    flag (`describe_offset` names a heap offset), after how long, expecting and seeing what."""
    if record[ERR_CODE] == 0:
        return None
    # the bound the wait had (a record written by hand, as in tests, has none: the current one)
    bound = record[ERR_BOUND_NS] / 1e9 if record[ERR_BOUND_NS] > 0 else timeout_s
    return (f"rank {record[ERR_RANK]} gave up after {bound:g} s waiting for rank "
            f"{record[ERR_PEER]} to set flag {describe_offset(record[ERR_FLAG_OFFSET])} to epoch "
            f"{record[ERR_EXPECTED]} (saw {record[ERR_SEEN]}); the peer crashed, hung, or the ranks "
            f"issued different collectives. The heap is unusable now; restart the group.")
