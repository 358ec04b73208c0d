"""Request-length workloads shared by the offline and the HTTP benchmarks.

`lognormal_lengths` stands in for a ShareGPT-style serving set without downloading one: real chat
traffic has many short prompts and answers and a long tail of long ones, which a fixed length never
exercises (mixed prefill/decode steps, batch sizes that change every step). The lengths are drawn
in code from a seeded generator, so both engines of a comparison get the very same list.
"""

from __future__ import annotations

import math
import random

# Shorter requests than this make steps of almost pure overhead; ShareGPT filters drop them too.
MIN_LEN = 4


def lognormal_lengths(n: int, input_median: int, output_median: int, sigma: float, max_len: int,
                      seed: int) -> list[tuple[int, int]]:
    """n (input, output) length pairs, each lognormal around its median with shape sigma, clipped so that
    every request fits max_len (the engine's max_model_len) in total."""
    if max_len < 2 * MIN_LEN:
        raise ValueError(f"max_len must be at least {2 * MIN_LEN}, got {max_len}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = round(rng.lognormvariate(math.log(max(input_median, 1)), sigma))
        o = round(rng.lognormvariate(math.log(max(output_median, 1)), sigma))
        i = min(max(i, MIN_LEN), max_len - MIN_LEN)
        out.append((i, min(max(o, MIN_LEN), max_len - i)))
    return out
