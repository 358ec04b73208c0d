"""The engine: requests in, tokens out. `LLM` for offline batches, `AsyncLLM` for streaming servers.

Process model: serving/workers.py. On torchrun ranks > 0 the constructor serves steps until rank 0
shuts down (`is_driver` is False).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence as Seq, Union

import torch

from .block_manager import BlockManager
from .config import EngineConfig, RequestError, SamplingParams, default_device, env_rank_world, resolve_model_dir
from .layer_factory import require_triton_interpreter
from .runner import SamplingBatch, StepResult
from .sampler import TokenState
from .scheduler import NeedsPreemption, Scheduler, Sequence, Status
from .step_message import StepInput
from .step_trace import StepTrace
from .structured import StructuredOutputs
from .tokenizer import ByteTokenizer, IncrementalDetokenizer, load_tokenizer
from .workers import Workers

Prompt = Union[str, list[int]]

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]   # "stop" | "length" | "abort" | None while running
    # per token, its top_logprobs most likely (id, logprob), best first, when asked for
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_logits: Optional[torch.Tensor] = None   # [prompt_len, vocab] when requested, once finished
    num_preemptions: int = 0


@dataclass
class _Launched:
    """A step whose device work is queued; `_finalize` turns it into outputs once its draw is on the host."""
    scheduled: list            # (seq, tokens computed)
    sampled: list              # the sequences that sampled, in the order of the sampled tokens
    prompt_logits: list        # (seq, device tensor [n, vocab])
    result: StepResult         # the runner's: draw, ready event, error slot


def engine_tokenizer(cfg: EngineConfig, mcfg) -> tuple:
    """(tokenizer or None, end-of-sequence ids) of an engine's model: the engine and the server process
    that validates its requests load the same one."""
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, weights=False), cfg.tokenizer)
    eos_ids = set(mcfg.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)
    elif tokenizer is None and cfg.effective_load_format() == "dummy":
        # A shipped config benchmarked with dummy weights has no tokenizer files: the byte
        # tokenizer stands in (its ids past 255 show as placeholders), so text and streams work
        # as with a real model. Its end-of-sequence id is not the model's and is not used.
        tokenizer = ByteTokenizer()
    return tokenizer, eos_ids


class RequestValidator:
    """Every check of a request that needs no engine state: the engine runs it, and so does the HTTP
    server's process before a request travels to the engine-core process, so bad input fails there."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, structured: StructuredOutputs):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured

    def validate(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None) -> tuple:
        """(prompt text or None, token ids, SamplingParams, compiled grammar or None); ValueError,
        TypeError or RequestError (a sampling parameter) naming what is wrong."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams or dict, not {type(params).__name__}")
        text: Optional[str] = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer; pass the prompt as token ids")
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("a prompt is a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty; at least one token is required")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                             f"it must be at most {self.max_model_len - 1} to leave room for one output token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               "logit_bias")
        compiled = None
        if params.structured_output is not None:
            try:
                compiled = self.structured.compile(params.structured_output)
            except ValueError as e:
                raise RequestError(str(e), "structured_output") from None
        return text, ids, params, compiled


def output_delta(seq: Sequence, delta: str, delta_ids: list[int]) -> tuple:
    """What one step added to a request, as a plain tuple (cheap to pickle): (request id, delta text,
    delta ids, their logprobs or None, their top logprobs or None, finish reason, preemptions, final).
    `final` is None while the request runs; once it finished, (text, token ids, logprobs, top logprobs,
    prompt logits) in full, since a stop string may cut text that an earlier delta carried.
    `RequestStream.output` turns the deltas of one request back into RequestOutputs."""
    p, n = seq.params, len(delta_ids)
    final = None
    if seq.status is Status.FINISHED:
        pl = torch.cat(seq.prompt_logits) if p.prompt_logits and seq.prompt_logits else None
        final = (seq.text, seq.output_ids, list(seq.logprobs) if p.logprobs else None,
                 list(seq.top_logprobs) if p.top_logprobs else None, pl)
    return (seq.request_id, delta, delta_ids, seq.logprobs[-n:] if p.logprobs and n else None,
            seq.top_logprobs[-n:] if p.top_logprobs and n else None, seq.finish_reason, seq.num_preemptions,
            final)


class RequestStream:
    """One request's outputs rebuilt from its `output_delta`s, on the receiving side: the same
    RequestOutputs that LLMEngine returns without deltas."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []

    def output(self, d: tuple) -> RequestOutput:
        _, delta, delta_ids, lps, tops, reason, preemptions, final = d
        pl = None
        if final is not None:
            self.text, self.token_ids, all_lps, all_tops, pl = final
            self.logprobs, self.top_logprobs = all_lps or [], all_tops or []
        else:
            self.text += delta
            self.token_ids += delta_ids
            if lps:
                self.logprobs += lps
            if tops:
                self.top_logprobs += tops
        p = self.params
        comp = CompletionOutput(0, self.text, list(self.token_ids), list(self.logprobs) if p.logprobs else None,
                                reason, list(self.top_logprobs) if p.top_logprobs else None)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [comp], final is not None, delta,
                             delta_ids, pl, preemptions)


class LLMEngine:
    """Single-threaded core: add_request / abort_request / step. Not thread-safe; AsyncLLM serialises."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        cfg = config if config is not None else EngineConfig(**kwargs)
        self.cfg = cfg
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(cfg.tensor_parallel_size)   # fail before any process is spawned
        require_triton_interpreter(cfg, default_device(cfg), cfg.tensor_parallel_size)
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
        self.tokenizer, self.eos_ids = engine_tokenizer(cfg, self.mcfg)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   on_leave=self._release_state)
        # Rows for the penalties and logit_bias: only running sequences sample, at most max_num_seqs.
        self.token_state = TokenState(cfg.max_num_seqs, self.mcfg.vocab_size, self.device)
        self.structured = StructuredOutputs(self.tokenizer, self.mcfg.vocab_size, self.eos_ids)
        self.validator = RequestValidator(self.tokenizer, self.mcfg.vocab_size, self.max_model_len, self.structured)
        # The engine-core process asks for compact per-step deltas (see `output_delta`) instead of
        # RequestOutputs: no full-text copies on the step path, and a small message to pickle.
        self.emit_deltas = False
        self._pending: Optional[_Launched] = None   # async scheduling: the step launched but not finalised
        self.last_result: Optional[StepResult] = None   # the latest step's (whether it replayed graphs)
        self._trace = StepTrace.from_env(self.device)   # None unless TP_OVERLAP_STEP_TRACE names a file
        self._ids = itertools.count()
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

    def make_sequence(self, request_id: Optional[str], prompt: Prompt,
                      params: Optional[Union[SamplingParams, dict]] = None) -> Sequence:
        """Validate a request without touching engine state (safe from any thread)."""
        self._require_driver()
        text, ids, params, compiled = self.validator.validate(prompt, params)
        return self.sequence_of(request_id, text, ids, params, compiled)

    def sequence_of(self, request_id: Optional[str], text: Optional[str], ids: list[int], params: SamplingParams,
                    compiled=None) -> Sequence:
        """The Sequence of a request that `RequestValidator.validate` accepted (`compiled`: its grammar)."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        seq = Sequence(rid, text, ids, params)
        if compiled is not None:
            seq.grammar = self.structured.matcher(compiled)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def _release_state(self, seq: Sequence) -> None:
        """The scheduler's hook for a sequence that finishes or is preempted: its TokenState row is free
        (a preempted one is rebuilt from its tokens when it samples again)."""
        if seq.state_row >= 0:
            self.token_state.release(seq.state_row)
            seq.state_row = -1

    def add_request(self, request_id: Optional[str], prompt: Prompt,
                    params: Optional[Union[SamplingParams, dict]] = None) -> str:
        seq = self.make_sequence(request_id, prompt, params)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Drop a request now; its KV blocks are free when this returns."""
        seq = self.scheduler.abort(str(request_id))
        return None if seq is None else self._output(seq, "", [])

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
    def step(self) -> list[RequestOutput]:
        """One model step. With async scheduling the step launched here is finalised (tokens appended,
        stops checked, text detokenised) by the next call, after that call has launched its own step:
        the host does this work while the device runs. A sequence that stops on a token it cannot
        foresee (end of sequence, stop string) was already scheduled once more; that extra token is
        computed and dropped, never emitted."""
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
            return self._finalize(pending) if pending is not None else []
        launched, outputs = self._launch(batch, pending)
        if outputs is None:
            outputs = self._finalize(pending) if pending is not None else []
        if self.cfg.async_scheduling and not launched.prompt_logits:
            self._pending = launched
            return outputs
        return outputs + self._finalize(launched)

    def _launch(self, batch, pending: Optional["_Launched"] = None) -> tuple["_Launched", Optional[list]]:
        """Queue a step's forward and sampling. Returns it, and `pending`'s outputs if it had to finalise
        `pending` itself (else None): a sequence with a structured output needs the token that the step
        in flight sampled for it accepted by its grammar before its next mask is built. That wait comes
        after this step's forward is queued, so the device still computes while the host waits and
        fills the masks; only the sampling launch is delayed, and only while such sequences run."""
        t_scheduled = time.perf_counter()
        # Per sequence, never per token: positions and cache slots are derived from the sequences'
        # lengths and block tables in whole-array ops by the runner (serving/step_layout.py).
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
        if pending is not None and any(s.grammar is not None and s.inflight for s in seqs):
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
            p = seq.params
            # Known now: this token ends the sequence whatever it is, so the next step leaves it out.
            seq.last_inflight = (seq.num_output + seq.inflight >= p.max_tokens
                                 or seq.num_tokens >= self.max_model_len)
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
        masked = [i for i, (s, ok) in enumerate(zip(seqs, live)) if ok and s.grammar is not None]
        if masked:
            assert all(seqs[i].inflight == 0 for i in masked)   # see _launch
            kw.update(token_bitmask=self.structured.fill([seqs[i].grammar for i in masked], masked, len(seqs),
                                                         self.device), masked=masked)
        return kw

    def _finalize(self, step: "_Launched") -> list[RequestOutput]:
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
                      top: Optional[list[tuple[int, float]]] = None) -> RequestOutput:
        if seq.grammar is not None and not seq.grammar.accept_token(tok):
            # Its mask allowed the token, so the grammar cannot refuse it, unless the grammar library
            # errs; then this request ends here, not the engine with every other request.
            log.error("request %s: the grammar refused token %d that its own mask allowed; request aborted",
                      seq.request_id, tok)
            self.scheduler.finish(seq, "abort")
            return self._output(seq, "", [])
        seq.tokens.append(tok)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top_logprobs.append(top)
        p = seq.params
        delta = ""
        reason = None
        if not p.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
        elif seq.detok is not None:
            delta = seq.detok.push(tok)
        if reason is None and (seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None and seq.detok is not None:
            # Text held back for a character that might continue (also when an end-of-sequence or
            # stop token ends the output) is final now.
            delta += seq.detok.flush()
        if delta and p.stop:
            # Only the new text and the longest stop string's worth before it can hold a new match.
            tail = max(len(s) for s in p.stop) + len(delta)
            start = max(0, len(seq.text) + len(delta) - tail)
            full = seq.text + delta
            hits = [(full.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                cut = i + len(s) if p.include_stop_str_in_output else i
                delta = full[len(seq.text):cut] if cut > len(seq.text) else ""
                full = full[:cut]
                reason = "stop"
            seq.text = full
        else:
            seq.text += delta
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq, delta, [tok])

    def _output(self, seq: Sequence, delta: str, delta_ids: list[int]) -> RequestOutput:
        if self.emit_deltas:
            return output_delta(seq, delta, delta_ids)
        done = seq.status is Status.FINISHED
        pl = None
        if done and seq.params.prompt_logits and seq.prompt_logits:
            pl = torch.cat(seq.prompt_logits)
        comp = CompletionOutput(0, seq.text, seq.output_ids,   # (a fresh list)
                                list(seq.logprobs) if seq.params.logprobs else None, seq.finish_reason,
                                list(seq.top_logprobs) if seq.params.top_logprobs else None)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_ids), [comp], done, delta,
                             delta_ids, pl, seq.num_preemptions)


class LLM:
    """Offline batch API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        self.engine = LLMEngine(config, **kwargs)

    @property
    def is_driver(self) -> bool:
        return self.engine.is_driver

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Seq[Prompt]],
                 sampling_params: Union[None, SamplingParams, dict, Seq[SamplingParams]] = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            plist = list(sampling_params)
        else:
            plist = [sampling_params] * len(prompts)
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                seqs.append(self.engine.make_sequence(None, p, sp))
            except RequestError:   # about the sampling parameters, not this prompt
                raise
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
        for s in seqs:
            self.engine.add_sequence(s)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(seqs):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for s in seqs:
                if s.request_id not in final:
                    self.engine.abort_request(s.request_id)
            raise
        return [final[s.request_id] for s in seqs]

    def chat(self, conversations, sampling_params=None) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class AsyncLLM:
    """Streaming API for servers. The step loop runs in an engine-core process of its own
    (serving/engine_core.py says why and how); this process validates requests, keeps one asyncio
    queue per stream and fans each step's outputs out to them. No coroutine waits for a model step.

        engine = AsyncLLM(EngineConfig(...))
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.delta_text)
        engine.abort("req-1")

    `in_thread=True` runs the same core loop on a thread of this process instead (debugging).
    `core_setup(engine)` runs in the core once its LLMEngine is built; it must pickle (a module-level
    function), and tests use it to inject faults. Under torchrun, ranks > 0 serve rank 0's steps in
    this constructor (`is_driver` False); rank 0's core process inherits the launch environment.
    """

    def __init__(self, config: Optional[EngineConfig] = None, *, in_thread: bool = False, core_setup=None,
                 **kwargs):
        from .engine_core import EngineCoreClient

        cfg = config if config is not None else EngineConfig(**kwargs)
        self.engine: Optional[LLMEngine] = None
        launched = env_rank_world()
        self.is_driver = launched is None or launched[0] == 0
        if not self.is_driver:
            self.engine = LLMEngine(cfg)   # serves rank 0's steps until it shuts down
            return
        self.cfg = cfg
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(cfg.tensor_parallel_size)   # fail before any process is spawned
        self.tokenizer, eos_ids = engine_tokenizer(cfg, self.mcfg)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestStream]] = {}
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._ids = itertools.count()
        self.core = EngineCoreClient(cfg, self._on_step, self._on_error, in_thread=in_thread, setup=core_setup)
        info = self.core.info
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.num_blocks: int = info["num_blocks"]
        self.eos_ids = set(info["eos_ids"])
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len,
                                          StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids))
        ref = weakref.ref(self)
        # Before multiprocessing's own exit hook, which would wait for the core forever.
        atexit.register(lambda: ref() is not None and ref().shutdown())

    # ---- the core's side (its reader thread) -------------------------------------------------
    def _on_step(self, deltas: list, rejected: list) -> None:
        """One message per step: group its items by the event loop of their stream, one wake-up each."""
        by_loop: dict = {}
        for d in deltas:
            t = self._streams.get(d[0])
            if t is not None:
                by_loop.setdefault(t[0], []).append((t[1], d))
        for rid, msg in rejected:
            t = self._streams.get(rid)
            if t is not None:
                by_loop.setdefault(t[0], []).append((t[1], RuntimeError(f"the engine rejected the request: {msg}")))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # the consumer's event loop is gone
                pass

    def _on_error(self, e: BaseException) -> None:
        self._error = e
        self._fail_streams(e)

    def _fail_streams(self, e: BaseException) -> None:
        for loop, q, _ in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, e)
            except RuntimeError:
                pass

    # ---- requests ----------------------------------------------------------------------------
    def alive(self) -> bool:
        """True while the engine can serve (the health check)."""
        return self._error is None and not self._stopped and self.core.alive()

    def stats(self) -> dict:
        """The engine's `LLMEngine.stats()` after its latest step."""
        return self.core.stats

    def _require_running(self) -> None:
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine failed earlier and must be restarted: {self._error}")

    def check_request(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None) -> tuple:
        """Validate a request here, before it reaches the core: `RequestValidator.validate`'s result or
        its errors; RuntimeError when the engine cannot serve."""
        self._require_running()
        return self.validator.validate(prompt, params)

    async def generate(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise RuntimeError(f"the engine loop died: {self._error!r}")
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        if request_id is not None and str(request_id) in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, params, _ = self.validator.validate(prompt, params)   # raises on bad input, here
        rid = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        q: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(rid, text, ids, params)
        self._streams[rid] = (asyncio.get_running_loop(), q, stream)
        finished = False
        try:
            if self._error is not None:   # failed while this stream registered: no one would tell it
                raise RuntimeError(f"the engine loop died: {self._error!r}")
            self.core.send(("add", rid, text, ids, params))
            while True:
                d = await q.get()
                if isinstance(d, BaseException):
                    if d is self._error:
                        raise RuntimeError(f"the engine loop died: {d!r}") from d
                    raise d
                out = stream.output(d)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and self._error is None and not self._stopped:
                # The consumer went away (client disconnect, cancellation): free the blocks.
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request; the core frees its blocks before its next step."""
        try:
            self.core.send(("abort", str(request_id)))
        except RuntimeError:
            pass   # no core, no request to abort

    def shutdown(self) -> None:
        if not self.is_driver or self._stopped:
            return
        self._stopped = True
        self.core.shutdown()
        self._fail_streams(RuntimeError("the engine has been shut down"))


def _put_all(items: list) -> None:
    for q, d in items:
        q.put_nowait(d)
