"""Continuous batching with chunked prefill and preemption by recompute.

A sequence is a list of tokens of which the first `num_computed` have keys/values in the cache. Each
step the scheduler hands the runner, per sequence, the next slice of uncomputed tokens: one token for a
sequence that is decoding, a chunk for one that is prefilling. Prefill and decode therefore share one
code path and one step. When the cache runs out, the newest running sequence gives all its blocks
back and is recomputed from scratch later (its generated tokens become part of what it re-prefills).
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .block_manager import BlockManager
from ..config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass(eq=False)   # identity semantics: list.remove / `in` must never compare token lists or tensors
class Sequence:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logits: list[Any] = field(default_factory=list)  # tensors [n, vocab], in prompt order
    num_prompt_logits: int = 0
    generator: Any = None
    eos_ids: frozenset = frozenset()   # end-of-sequence ids (the front end's tokenizer's), unless ignore_eos
    num_preemptions: int = 0
    num_registered: int = 0     # leading blocks published to the prefix cache
    last_key: Any = None        # prefix-cache key of the last of them
    # Async scheduling: tokens sampled on the device whose ids the host does not have yet (at most two:
    # the step being finalised and the one just launched). They count in num_tokens, so the scheduler
    # plans the next step as if they were known; the step reads the newest from `inflight_ref`, its
    # index in the previous step's sampled ids. `last_inflight`: that token ends the sequence
    # whatever it is (max_tokens / max_model_len), so it is not scheduled again.
    inflight: int = 0
    inflight_ref: int = 0
    last_inflight: bool = False
    state_row: int = -1         # its row of the sampler's TokenState (penalties, logit_bias), -1: none
    grammar: Any = None         # structured output: the grammar matcher, advanced token by token
    bad_words_ids: tuple = ()   # (apiext) vLLM's bad_words, tokenized by the front end

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        self.last_key = self.cache_root

    @property
    def cache_root(self) -> Any:
        """Where this sequence's chain of prefix-cache keys starts: its cache_salt, so that requests with
        different salts (or none) never share a block."""
        return None if self.params.cache_salt is None else ("cache_salt", self.params.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.inflight

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        """len(output_ids) without the copy (on the host's per-token path)."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]        # tokens computed for each sequence this step
    num_decodes: int          # the first num_decodes entries have num_new == 1 and are past their prompt

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class NeedsPreemption(Exception):
    pass


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_leave: Optional[Callable[[Sequence], None]] = None):
        self.bm = block_manager
        # called when a sequence stops running (finished, aborted or preempted)
        self.on_leave = on_leave
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # ordered by arrival
        self.by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq.block_table)
        if self.on_leave is not None:
            self.on_leave(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Optional[Sequence]:
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def _reset(self, seq: Sequence) -> None:
        self.bm.free(seq.block_table)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.last_key = seq.cache_root

    def _preempt(self, seq: Sequence) -> None:
        # Its full blocks stay in the prefix cache, so the recompute is often mostly a cache hit.
        self._reset(seq)
        if self.on_leave is not None:
            self.on_leave(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        # Front of the queue: it was admitted before everything still waiting.
        self.waiting.appendleft(seq)

    def schedule(self, allow_preemption: bool = True) -> Optional[ScheduledBatch]:
        """The next step. With allow_preemption=False (a step is in flight, and a sequence holding a
        token the host has not seen cannot be recomputed), raises NeedsPreemption instead of preempting."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        taken: set[int] = set()

        # Decoding sequences first (one token each, latency matters), then unfinished prefills.
        order = [s for s in self.running if s.num_computed >= len(s.prompt_ids) and s.remaining == 1]
        order += [s for s in self.running if not (s.num_computed >= len(s.prompt_ids) and s.remaining == 1)]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:   # preempted as a victim earlier in this loop
                continue
            if seq.last_inflight:
                continue
            n = min(seq.remaining, budget)
            while not self.bm.ensure(seq.block_table, seq.num_computed + n):
                if not allow_preemption:
                    raise NeedsPreemption()
                victim = next((s for s in reversed(self.running) if id(s) not in taken), None)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            chosen.append((seq, n))
            taken.add(id(seq))
            budget -= n

        # Admit waiting sequences while the token budget, the sequence cap and free blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and not seq.params.prompt_logits:
                seq.block_table, seq.last_key = self.bm.match_prefix(seq.tokens, seq.cache_root)
                seq.num_computed = seq.num_registered = len(seq.block_table)
                seq.num_computed *= self.bm.block_size
            n = min(seq.remaining, budget)
            if not self.bm.ensure(seq.block_table, seq.num_computed + n):
                self._reset(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            # Kept in arrival order so that the newest sequence is always the one preempted.
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            chosen.append((seq, n))
            taken.add(id(seq))
            budget -= n

        if not chosen:
            return None
        decodes = [(s, n) for s, n in chosen if n == 1 and s.num_computed >= len(s.prompt_ids)]
        rest = [(s, n) for s, n in chosen if not (n == 1 and s.num_computed >= len(s.prompt_ids))]
        ordered = decodes + rest
        return ScheduledBatch([s for s, _ in ordered], [n for _, n in ordered], len(decodes))
