"""The engine core: the scheduler, the KV blocks, the ranks' runners and the sampling state, turning
processed requests (token ids and sampling params) into per-step token-id deltas.

It has no tokenizer and no text: the front end (front_end.py) processes requests before they come
here and turns the deltas into text, stop strings included. What ends a request on its ids is decided
here, in one place (`_finish_reason`): an end-of-sequence or stop token id, max_tokens, max_model_len.

`LLMEngine` (llm_engine.py) drives a core in its caller's process; under `AsyncLLM` the core process
(core_process.py) does. Single-threaded: add / abort / step.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import EngineConfig
from ..model.sampler import TokenState
from ..worker.runner import SamplingBatch, StepResult
from ..worker.step_message import StepInput
from ..worker.workers import Workers
from .block_manager import BlockManager
from .messages import OutputDelta, ProcessedRequest
from .scheduler import NeedsPreemption, Scheduler, Sequence, Status
from .step_trace import StepTrace
from .structured import StructuredOutputs

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step whose device work is queued; `_finalize` turns it into deltas once its draw is on the host."""
    scheduled: list            # (seq, tokens computed)
    sampled: list              # the sequences that sampled, in the order of the sampled tokens
    prompt_logits: list        # (seq, device tensor [n, vocab])
    result: StepResult         # the runner's: draw, ready event, error slot


class EngineCore:
    """Single-threaded: add / abort / step. Not thread-safe; its owner serialises."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(cfg.tensor_parallel_size)   # fail before any process is spawned
        self._closed = False
        self._broken: Optional[BaseException] = None
        self.workers = Workers(cfg)
        self.runner = self.workers.runner
        self.is_driver = self.workers.is_driver
        if not self.is_driver:   # a torchrun rank > 0: serve rank 0's steps until it shuts down
            self.runner.worker_loop()
            self.shutdown()
            return

        self.device = self.runner.device
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   on_leave=self._release_state)
        # Rows for the penalties and logit_bias: only running sequences sample, at most max_num_seqs.
        self.token_state = TokenState(cfg.max_num_seqs, self.mcfg.vocab_size, self.device)
        # Matchers and masks; grammars arrive compiled, or are compiled against the front end's vocabulary.
        self.structured = StructuredOutputs(None, self.mcfg.vocab_size, ())
        self._pending: Optional[_Launched] = None   # async scheduling: the step launched but not finalised
        self.last_result: Optional[StepResult] = None   # the latest step's (whether it replayed graphs)
        self._trace = StepTrace.from_env(self.device)   # None unless TP_OVERLAP_STEP_TRACE names a file
        # A weak reference, so that registering for exit does not keep every engine (and its KV cache) alive.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_trace", None) is not None:
            self._trace.close()
        self.workers.shutdown(stop_workers=self._broken is None)

    # ---- requests ----------------------------------------------------------------------------
    def _require_driver(self) -> None:
        if not self.is_driver:
            raise RuntimeError("this rank is a worker; only rank 0 accepts requests")
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if self._broken is not None:
            raise RuntimeError(f"the engine failed earlier and must be restarted: {self._broken}")

    def add(self, request_id: str, request: ProcessedRequest) -> None:
        """Schedule a processed request; nothing of it is checked again. Its grammar, when it has a
        structured output, is compiled here unless the request carries it."""
        self._require_driver()
        params = request.params
        seq = Sequence(request_id, request.prompt, request.prompt_ids, params, eos_ids=request.eos_ids,
                       bad_words_ids=request.bad_words_ids)
        if params.structured_output is not None:
            grammar = request.grammar if request.grammar is not None else self.structured.compile(
                params.structured_output)
            seq.grammar = self.structured.matcher(grammar)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.scheduler.add(seq)

    def _release_state(self, seq: Sequence) -> None:
        """The scheduler's hook for a sequence that finishes or is preempted: its TokenState row is free
        (a preempted one is rebuilt from its tokens when it samples again)."""
        if seq.state_row >= 0:
            self.token_state.release(seq.state_row)
            seq.state_row = -1

    def abort(self, request_id: str) -> Optional[OutputDelta]:
        """Drop a request now; its KV blocks are free when this returns. Its last delta, or None if it
        is not here (finished, or never added)."""
        seq = self.scheduler.abort(str(request_id))
        return None if seq is None else delta_of(seq, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Scheduler and KV-pool state, and which path each TP op took on this rank (for /metrics)."""
        from tp_overlap_plugin import stats as tp_stats

        sched, bm = self.scheduler, self.block_manager
        total, free = bm.num_blocks, bm.num_free
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_cache_total_blocks": total,
            "kv_cache_free_blocks": free,
            "kv_cache_usage_perc": (total - free) / total if total else 0.0,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hit_blocks": bm.num_cache_hits,
            "tp_op_calls": tp_stats.snapshot(),
        }

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[OutputDelta]:
        """One model step: a delta per request it advanced (and per request that ended meanwhile).
        With async scheduling the step launched here is finalised (tokens appended, stops checked) by
        the next call, after that call has launched its own step: the host does this work while the
        device runs. A sequence that stops on a token it cannot foresee (an end-of-sequence or stop
        token) was already scheduled once more; that extra token is computed and dropped, never
        emitted. A stop string is the front end's to see: the tokens emitted before its abort arrives
        are dropped there."""
        self._require_driver()
        if self._trace is not None:
            self._trace.enter()
        pending = self._pending
        self._pending = None
        try:
            batch = self.scheduler.schedule(allow_preemption=pending is None)
        except NeedsPreemption:
            # Preemption recomputes a sequence from its tokens, so they must all be on the host first.
            outputs = self._finalize(pending)
            batch = self.scheduler.schedule()
            return outputs + (self._finalize(self._launch(batch)[0]) if batch is not None else [])
        if batch is None:
            outputs = self._finalize(pending) if pending is not None else []
        else:
            launched, outputs = self._launch(batch, pending)
            if outputs is None:
                outputs = self._finalize(pending) if pending is not None else []
            if self.cfg.async_scheduling and not launched.prompt_logits:
                self._pending = launched
            else:
                outputs += self._finalize(launched)
        return outputs

    def _launch(self, batch, pending: Optional["_Launched"] = None) -> tuple["_Launched", Optional[list]]:
        """Queue a step's forward and sampling. Returns it, and `pending`'s outputs if it had to finalise
        `pending` itself (else None): a sequence with a structured output needs the token that the step
        in flight sampled for it accepted by its grammar before its next mask is built. That wait comes
        after this step's forward is queued, so the device still computes while the host waits and
        fills the masks; only the sampling launch is delayed, and only while such sequences run."""
        t_scheduled = time.perf_counter()
        # Per sequence, never per token: positions and cache slots are derived from the sequences'
        # lengths and block tables in whole-array ops by the runner (serving/worker/step_layout.py).
        ids, rows = [], []
        sample_at: list[tuple[Sequence, int]] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []   # seq, first row, count
        t = 0
        for seq, n in zip(batch.seqs, batch.num_new):
            c = seq.num_computed
            known = seq.tokens[c:c + n]
            ids += known
            if len(known) < n:   # the token sampled by the step in flight: still on the device
                ids.append(-1 - seq.inflight_ref)
            if seq.params.prompt_logits:
                lo, hi = max(c, seq.num_prompt_logits), min(c + n, len(seq.prompt_ids))
                if hi > lo:
                    prompt_rows.append((seq, len(rows), hi - lo))
                    rows += range(t + lo - c, t + hi - c)
            if c + n == seq.num_tokens:
                sample_at.append((seq, len(rows)))
                rows.append(t + n - 1)
            t += n
        step = StepInput(ids, list(batch.num_new),
                         [s.num_computed + n for s, n in zip(batch.seqs, batch.num_new)],
                         [list(s.block_table) for s in batch.seqs], batch.num_decodes, rows,
                         share_sampled=self.cfg.async_scheduling)
        seqs = [s for s, _ in sample_at]
        early = None
        rec = self._trace.start(batch, t_scheduled) if self._trace is not None else None
        try:
            result = self.runner.execute(step)
            prompt_logits = [(seq, result.logits[r0:r0 + cnt].float()) for seq, r0, cnt in prompt_rows]
        except Exception as e:
            self._fail(e)
        if pending is not None and any(s.inflight and (s.grammar is not None or s.bad_words_ids and _has_long_bad_word(s))
                                      for s in seqs):
            early = self._finalize(pending)
        try:
            sampling = None
            if seqs:
                sampling = SamplingBatch([r for _, r in sample_at], [s.params for s in seqs],
                                         [s.generator for s in seqs], **self._sampling_state(seqs))
            result = self.runner.sample(result, sampling)
            if rec is not None:
                self._trace.end(rec, result.graph)
        except Exception as e:
            self._fail(e)
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
        for k, seq in enumerate(seqs):
            seq.inflight += 1
            seq.inflight_ref = k
            # Known now: this token ends the sequence whatever it is, so the next step leaves it out.
            seq.last_inflight = self._reaches_length(seq, seq.inflight)
        self.last_result = result
        return _Launched(list(zip(batch.seqs, batch.num_new)), seqs, prompt_logits, result), early

    def _fail(self, e: Exception):
        # Ranks may now disagree about what was computed; nothing after this can be trusted.
        workers = self.workers.errors()
        self._broken = e
        raise RuntimeError(f"model step failed: {e}" + (f"; workers: {workers}" if workers else "")) from e

    # How often a waiting host asks whether a step has finished. Under async scheduling the next step
    # is already queued behind it, so finding out this much later leaves the GPU no less busy.
    READY_POLL_S = 50e-6

    def step_wait_bound_s(self) -> float:
        """How long the host waits for a step before it calls the group broken. Every wait inside the
        heap's kernels gives up after the heap's bound, so a step that has not finished twice that later
        is stuck where nothing gives up: a collective (NCCL or RCCL) that a stopped peer never joins."""
        heap = getattr(self.runner, "heap", None)
        return 2 * heap.timeout_s + 5 if heap is not None else self.cfg.dist_timeout_s

    def _wait_ready(self, ready: "torch.cuda.Event") -> None:
        """ready.synchronize(), bounded: a blocking synchronize on a stuck collective never returns."""
        if ready.query():
            return
        bound = self.step_wait_bound_s()
        deadline = time.monotonic() + bound
        while not ready.query():
            if time.monotonic() > deadline:
                workers = self.workers.errors()
                e = TimeoutError(f"the step did not finish within {bound:g} s: a rank is stuck outside the heap's "
                                 f"bounded waits, in a collective" + (f"; workers: {workers}" if workers else ""))
                self._broken = e
                raise RuntimeError(f"model step failed: {e}") from e
            time.sleep(self.READY_POLL_S)

    def _sampling_state(self, seqs: list[Sequence]) -> dict:
        """SamplingBatch's per-sequence state for this step: TokenState rows (acquired on a sequence's
        first sample) and the structured-output bitmask. A sequence that finished meanwhile (its extra
        step) samples unconstrained; its token is dropped."""
        live = [s.status is not Status.FINISHED for s in seqs]
        for s, ok in zip(seqs, live):
            if ok and s.state_row < 0 and s.params.needs_token_state:
                # Its first sample since it was admitted: every token it has is on the host.
                assert s.inflight == 0
                s.state_row = self.token_state.acquire(s.prompt_ids, s.output_ids, s.params)
        kw: dict = {}
        if any(s.state_row >= 0 for s in seqs):
            kw.update(state=self.token_state, state_rows=[s.state_row if ok else -1 for s, ok in zip(seqs, live)])
        # (apiext) min_tokens: the token this step samples is output token num_output + inflight + 1 (async
        # scheduling launches before the host has the previous ones); until min_tokens are out, the
        # end-of-sequence and stop ids cannot be drawn.
        banned = [(i, t) for i, (s, ok) in enumerate(zip(seqs, live))
                  if ok and s.params.min_tokens and s.num_output + s.inflight < s.params.min_tokens
                  for t in _stop_ids(s)]
        # (apiext) bad_words: a word's last token cannot follow its other tokens (a one-token word: never).
        # A sequence with a longer word has all its tokens on the host here (see _launch).
        banned += [(i, t) for i, (s, ok) in enumerate(zip(seqs, live)) if ok and s.bad_words_ids
                   for t in _bad_word_ends(s)]
        if banned:
            kw.update(banned=torch.tensor(banned, dtype=torch.int64).T.to(self.device))
        masked = [i for i, (s, ok) in enumerate(zip(seqs, live)) if ok and s.grammar is not None]
        if masked:
            assert all(seqs[i].inflight == 0 for i in masked)   # see _launch
            kw.update(token_bitmask=self.structured.fill([seqs[i].grammar for i in masked], masked, len(seqs),
                                                         self.device), masked=masked)
        return kw

    def _finalize(self, step: "_Launched") -> list[OutputDelta]:
        bm = self.block_manager
        caching, bs = bm.enable_prefix_caching, bm.block_size
        for seq, _ in step.scheduled:
            if seq.status is Status.FINISHED:   # stopped or aborted while this step ran: its blocks are gone
                continue
            known = min(seq.num_computed, len(seq.tokens))
            if caching and known // bs > seq.num_registered:   # a block filled up (a decode: 1 step in 16)
                seq.num_registered, seq.last_key = bm.register(seq.block_table, seq.tokens, known,
                                                               seq.num_registered, seq.last_key)
        for seq, chunk in step.prompt_logits:
            seq.prompt_logits.append(chunk.cpu())
            seq.num_prompt_logits += chunk.shape[0]
        outputs = []
        if step.sampled:
            result = step.result
            if result.ready is not None:
                self._wait_ready(result.ready)
            try:
                self.runner.check_step(result.error_slot)   # no garbage tokens from a step that failed
            except Exception as e:
                self._broken = e
                raise RuntimeError(f"model step failed: {e}") from e
            d = result.draw
            toks = d.tokens.tolist()
            lps = d.logprobs.tolist() if d.logprobs is not None else [None] * len(toks)
            top_ids = d.top_ids.tolist() if d.top_ids is not None else None
            top_lps = d.top_logprobs.tolist() if d.top_logprobs is not None else None
            for i, (seq, tok, lp) in enumerate(zip(step.sampled, toks, lps)):
                seq.inflight -= 1
                if seq.status is Status.FINISHED:
                    continue   # the extra step after a stop, or an abort: computed, never emitted
                k = seq.params.top_logprobs
                top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k else None
                outputs.append(self._append_token(seq, tok, lp, top))
        return outputs

    def _append_token(self, seq: Sequence, tok: int, logprob: Optional[float],
                      top: Optional[list[tuple[int, float]]] = None) -> OutputDelta:
        if seq.grammar is not None and not seq.grammar.accept_token(tok):
            # Its mask allowed the token, so the grammar cannot refuse it, unless the grammar library
            # errs; then this request ends here, not the engine with every other request.
            log.error("request %s: the grammar refused token %d that its own mask allowed; request aborted",
                      seq.request_id, tok)
            self.scheduler.finish(seq, "abort")
            return delta_of(seq, [])
        seq.tokens.append(tok)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top_logprobs.append(top)
        reason = self._finish_reason(seq, tok)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return delta_of(seq, [tok])

    def _finish_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        """Whether `tok`, just appended, ends `seq`: the one place the core decides a stop. "stop" means
        the token is an end-of-sequence or stop token id (the front end shows no text for it); (apiext)
        not before min_tokens are out (the sampler cannot draw those ids until then)."""
        p = seq.params
        if ((not p.ignore_eos and tok in seq.eos_ids) or tok in p.stop_token_ids) and seq.num_output > p.min_tokens:
            return "stop"
        return "length" if self._reaches_length(seq, 0) else None

    def _reaches_length(self, seq: Sequence, ahead: int) -> bool:
        """With `ahead` more tokens, `seq` has all it may have: max_tokens, or max_model_len in all."""
        return seq.num_output + ahead >= seq.params.max_tokens or len(seq.tokens) + ahead >= self.max_model_len


def _has_long_bad_word(seq: Sequence) -> bool:
    """Whether `seq` has a bad word of several tokens, whose ban depends on its latest tokens."""
    return any(len(w) > 1 for w in seq.bad_words_ids)


def _bad_word_ends(seq: Sequence) -> set[int]:
    """The tokens `seq` may not sample next: the last token of each bad word whose other tokens end its
    output (vLLM looks at the output only, not the prompt)."""
    out, n = set(), seq.num_output
    for word in seq.bad_words_ids:
        k = len(word) - 1
        if k == 0 or (n >= k and tuple(seq.tokens[len(seq.tokens) - k:]) == word[:-1]):
            out.add(word[-1])
    return out


def _stop_ids(seq: Sequence) -> list[int]:
    """The ids that end `seq` when drawn: its stop token ids, and the end-of-sequence ids unless ignored."""
    p = seq.params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_ids)))


def delta_of(seq: Sequence, token_ids: list[int]) -> OutputDelta:
    """What this step added to `seq`: `token_ids` and their logprobs when asked for; the prompt's logits
    with its first output token (or with an abort that came first)."""
    p, n = seq.params, len(token_ids)
    prompt_logits = None
    if p.prompt_logits and seq.prompt_logits and (seq.num_output == n if n else seq.status is Status.FINISHED):
        prompt_logits = torch.cat(seq.prompt_logits)
    return OutputDelta(seq.request_id, token_ids, seq.logprobs[-n:] if p.logprobs and n else None,
                       seq.top_logprobs[-n:] if p.top_logprobs and n else None, seq.finish_reason,
                       seq.num_preemptions, prompt_logits)
