"""Counters of which path each op took, so tests and logs can prove a kernel ran (and was not a
silent fallback to the stock op)."""

from collections import Counter

calls: Counter = Counter()


def record(name: str) -> None:
    calls[name] += 1


def snapshot() -> dict:
    return dict(calls)
