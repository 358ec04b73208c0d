"""Counters of which path each op took, so tests and logs can prove a kernel ran (and was not a
silent fallback to the stock op)."""

from collections import Counter

calls: Counter = Counter()


def record(name: str) -> None:
    calls[name] += 1


def snapshot() -> dict:
    return dict(calls)


def since(before: dict) -> dict:
    """The counts recorded after `before` (a snapshot()): which paths a stretch of work took."""
    return {name: n - before.get(name, 0) for name, n in calls.items() if n > before.get(name, 0)}
