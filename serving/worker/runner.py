"""Model runner: one per rank. Holds the model shard and the KV cache, turns a step into logits, and
on rank 0 samples them.

Rank 0 owns the scheduler; it broadcasts each `StepInput` (step_message.py) over a gloo group, and every
rank, itself included, builds the same tensors and runs the same forward. Only collectives inside the
TP layers connect the forwards. A step is two calls: `execute` queues the forward and returns the
step's `StepResult`; `sample` (rank 0) samples the rows the engine names, hands the tokens to the next
step on the device (async scheduling, sampled_ids.py) and starts their copy to the host. Between the
two the engine may wait for the step before (a grammar needs its token) while the device computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from tp_overlap_plugin.layers import TPGroup
from tp_overlap_plugin.overlap_plan import OverlapPlan

from ..model import weights as W
from ..model.attention import AttnMeta
from ..config import EngineConfig, ModelConfig, SamplingParams, resolve_model_dir
from .cuda_graphs import DecodeGraphs, graph_batch_sizes
from .error_watch import ErrorWatch
from .layer_factory import make_layers
from ..model.model import CausalLM
from .piecewise import PiecewiseGraphs, default_token_counts, large_buckets
from .sampled_ids import SampledIds
from ..model.sampler import Sampled, TokenState, sample_on_device
from .step_layout import Staging, layout
from .step_message import StepInput, StepMessage

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SamplingBatch:
    """What rank 0 samples from a step: which of its logit rows, with which parameters, and the
    per-sequence state the sampler reads (sampler.sample_on_device says what each is)."""
    rows: list[int]                              # indexes into the step's logit rows, one per sequence
    params: list[SamplingParams]
    generators: list                             # per sequence: its seeded torch.Generator or None
    state: Optional[TokenState] = None           # penalties and logit_bias
    state_rows: Optional[list[int]] = None
    token_bitmask: Optional[torch.Tensor] = None  # structured output
    masked: Optional[list[int]] = None
    banned: Optional[torch.Tensor] = None        # min_tokens: [2, n] (batch row, token id) pairs


@dataclass
class StepResult:
    """One step on this rank. `execute` fills the first four; `sample` (rank 0) the draw."""
    logits: Optional[torch.Tensor]  # [logit rows, vocab] on the device until `sample` (prompt logits slice it)
    graph: bool                   # it replayed CUDA graphs (whole or piecewise)
    error_slot: int               # its ErrorWatch slot (tp_overlap), for `check_step`; -1: none
    share_sampled: bool           # its sampled ids feed the next step on the device
    draw: Optional[Sampled] = None          # the sampled tokens on the host once `ready` has fired
    ready: Optional[torch.cuda.Event] = None  # None: the draw is there already (the CPU)


def resolve_dtype(cfg: EngineConfig, mcfg: ModelConfig, device: str) -> torch.dtype:
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if device == "cpu":
        return torch.float32
    return _DTYPES.get(str(mcfg.torch_dtype).replace("torch.", ""), torch.bfloat16) \
        if mcfg.torch_dtype in ("bfloat16", "float16") else torch.bfloat16


def resolve_max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    if cfg.max_model_len is None:
        return mcfg.max_position_embeddings
    if cfg.max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings="
                         f"{mcfg.max_position_embeddings}")
    return cfg.max_model_len


class ModelRunner:
    def __init__(self, cfg: EngineConfig, rank: int, world_size: int, group, ctrl_group, device: torch.device,
                 plan: Optional[OverlapPlan]):
        """`plan`: this rank's plan for the flag (layer_factory.make_overlap_plan), None with the flag off."""
        self.cfg = cfg
        self.plan = plan
        self.rank, self.world_size = rank, world_size
        self.group, self.ctrl_group = group, ctrl_group
        self.device = device
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(world_size)
        self.max_model_len = resolve_max_model_len(cfg, self.mcfg)
        self.dtype = resolve_dtype(cfg, self.mcfg, device.type)
        self.block_size = cfg.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)

        self.layers, self.heap = make_layers(cfg, plan, self.mcfg, TPGroup(rank, world_size, group), ctrl_group,
                                             device, self.dtype)
        layers = self.layers
        # the ids sampled by the latest step, for the next (async scheduling); shared over `group`
        self.sampled = SampledIds(cfg.max_num_seqs, device, group if world_size > 1 else None)
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)   # rank 0's sampling
        with torch.device(device):
            self.model = CausalLM(self.mcfg, layers, self.max_model_len).eval()
        self._load_weights()
        self.scratch_block = 0          # until the cache exists; the profile run fills its tables fully
        self.use_triton = device.type == "cuda"
        self.staging = Staging(device) if device.type == "cuda" else None
        if self.heap is not None and (device.type != "cuda" or cfg.num_kv_blocks is not None):
            # One small step through the overlap layers on every rank (on GPUs the profile run
            # does this), so that kernels which cannot run here fail the start, not a request.
            self._profile_run(world_size)
            self.heap.check()
        self.errors = ErrorWatch(self.heap) if self.heap is not None else None
        self.piecewise: Optional[PiecewiseGraphs] = None
        self.messages = StepMessage(ctrl_group, rank) if world_size > 1 else None

        self.num_blocks = self._agree(self._kv_blocks_budget())
        # One extra physical block that the block manager never hands out: padded CUDA-graph rows write there.
        self.scratch_block = self.num_blocks
        kv_heads = self.mcfg.num_kv_heads // world_size
        shape = (self.num_blocks + 1, self.block_size, kv_heads, self.mcfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=device),
                           torch.zeros(shape, dtype=self.dtype, device=device))
                          for _ in range(self.mcfg.num_layers)]
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.scratch_block,
                                   self.max_blocks_per_seq, self.sampled.resolve)
        if self.heap is not None and device.type == "cuda":
            self._warm_overlap_shapes()
        graphs = device.type == "cuda" and not cfg.enforce_eager
        # One pool for every graph, the largest piecewise bucket first: a replay never overlaps another.
        self.graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        if graphs and cfg.piecewise_cuda_graphs:
            self.piecewise = self._piecewise(capture=True)
        if graphs:
            self.graphs.capture(graph_batch_sizes(cfg.cuda_graph_batch_sizes, cfg.max_num_seqs), device,
                                self.graph_pool)

    def release(self) -> None:
        """Drop the KV cache and graphs (the big allocations) once the engine is shut down."""
        self.graphs.clear()
        self.piecewise = None
        self.kv_caches = []
        if self.heap is not None:
            self.heap.close()
            self.heap = None

    # ---- setup -------------------------------------------------------------------------------
    def _load_weights(self) -> None:
        fmt = self.cfg.effective_load_format()
        show = self.cfg.show_progress and self.rank == 0
        if fmt == "demo":
            W.load_demo(self.model)
        elif fmt == "dummy":
            W.load_dummy(self.model, self.cfg.seed, self.rank)
        else:
            W.load_safetensors(self.model, resolve_model_dir(self.cfg.model), show_progress=show)

    def kv_bytes_per_block(self) -> int:
        kv_heads = self.mcfg.num_kv_heads // self.world_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.mcfg.num_layers * self.block_size * kv_heads * self.mcfg.head_dim * elem

    def _kv_blocks_budget(self) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            return self.cfg.kv_cache_bytes // per_block
        # Measure the activation peak of the largest step before carving the cache out of what is left.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.cfg.gpu_memory_utilization) - used_by_others - peak
        return max(budget // per_block, 0)

    def _profile_run(self, tokens: Optional[int] = None) -> None:
        n = min(tokens or self.cfg.max_num_batched_tokens, self.max_model_len)
        bs = self.block_size
        nb = -(-n // bs)
        shape = (nb, bs, self.mcfg.num_kv_heads // self.world_size, self.mcfg.head_dim)
        scratch_kv = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))
                      for _ in range(self.mcfg.num_layers)]
        step = StepInput(input_ids=[0] * n, q_lens=[n], context_lens=[n], block_tables=[list(range(nb))],
                         num_decodes=0, logit_rows=[n - 1])
        self._forward(step, scratch_kv)
        del scratch_kv

    def _warm_overlap_shapes(self) -> None:
        """One forward per step size of overlap_layers.warm_up_token_counts, on every rank alike, so
        that no kernel that waits on peers compiles mid-serving (a rank compiling stalls its peers)."""
        from tp_overlap_plugin.gemm_config import device_table
        from tp_overlap_plugin.overlap_layers import warm_up_token_counts
        table = device_table(self.device)
        limit = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        for n in warm_up_token_counts(limit, self.world_size, table.buckets if table is not None else ()):
            self._profile_run(n)
        self.heap.check()

    def _agree(self, n_blocks: int) -> int:
        # Rank 0 schedules for every rank, so all ranks must use the smallest pool any of them can hold.
        if self.world_size > 1:
            t = torch.tensor([n_blocks], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl_group)
            n_blocks = int(t.item())
        need = self.max_blocks_per_seq
        if n_blocks < need:
            raise ValueError(
                f"the KV cache holds {n_blocks} blocks of {self.block_size} tokens ({n_blocks * self.block_size} "
                f"tokens) but one sequence of max_model_len={self.max_model_len} needs {need} blocks; raise "
                f"kv_cache_bytes / gpu_memory_utilization / num_kv_blocks, or lower max_model_len")
        return n_blocks

    # ---- step --------------------------------------------------------------------------------
    def _step_tensors(self, step: StepInput, pad_to: Optional[int] = None):
        """(ids | positions | slots [3, T], logit rows, meta) on the device, and whether any id stands
        for a token still on the device: the per-token layout in whole-array numpy, then two
        asynchronous copies from pinned memory (step_layout.Staging). With `pad_to`, T is that
        (a piecewise-graph bucket): padded rows are token 0 at position 0 writing the scratch slot."""
        lay = layout(step.q_lens, step.context_lens, step.block_tables, self.block_size, self.scratch_block)
        n = len(step.input_ids)
        width = pad_to or n
        # rows of an even length: each row of the device copy starts 16-byte aligned (see Staging)
        tokens = np.zeros((3, width + width % 2), dtype=np.int64)
        tokens[0, :n], tokens[1, :n], tokens[2, :n] = step.input_ids, lay.positions, lay.slots
        tokens[2, n:] = self.scratch_block * self.block_size
        rows = np.asarray(step.logit_rows, dtype=np.int64)
        ctx = np.asarray(step.context_lens, dtype=np.int32)
        parts64, parts32 = [tokens, rows], [lay.cu_seqlens, ctx, lay.block_tables]
        if self.staging is not None:
            (d_tokens, d_rows), (d_cu, d_ctx, d_bt) = self.staging.to_device(parts64, parts32)
        else:
            d_tokens, d_rows, d_cu, d_ctx, d_bt = map(torch.from_numpy, parts64 + parts32)
        meta = AttnMeta(slot_mapping=d_tokens[2, :n], num_decodes=step.num_decodes, cu_seqlens_q=d_cu,
                        context_lens=d_ctx, block_tables=d_bt, max_q_len=max(step.q_lens), q_lens_list=step.q_lens,
                        context_lens_list=step.context_lens, use_triton=self.use_triton)
        return d_tokens[:, :width], d_rows, meta, bool(n and tokens[0, :n].min() < 0)

    @torch.inference_mode()
    def _forward(self, step: StepInput, kv_caches) -> torch.Tensor:
        tokens, rows, meta, has_refs = self._step_tensors(step)
        ids, pos = tokens[0], tokens[1]
        if has_refs:
            self.sampled.resolve(ids)
        hidden = self.model(ids, pos, meta, kv_caches)
        return self.model.compute_logits(hidden, rows)

    @torch.inference_mode()
    def _forward_piecewise(self, step: StepInput, bucket: int) -> torch.Tensor:
        tokens, rows, meta, _ = self._step_tensors(step, pad_to=bucket)
        hidden = self.piecewise.run(len(step.input_ids), bucket, tokens, meta)
        # the LM head on the rows asked for, eagerly: how many there are varies per step
        return self.model.compute_logits(hidden, rows)

    def _piecewise(self, capture: bool) -> PiecewiseGraphs:
        budget = self.cfg.max_num_batched_tokens
        counts = self.cfg.piecewise_graph_token_counts or default_token_counts(
            budget, large_buckets(budget, self.layers.graph_step))
        pw = PiecewiseGraphs(self.model, self.kv_caches, counts, self.scratch_block * self.block_size,
                             self.sampled.resolve, capture, self.graph_pool,
                             near_large=not self.cfg.piecewise_graph_token_counts)
        if capture:
            free0 = torch.cuda.mem_get_info(self.device)[0]
            pw.capture_all()
            if self.rank == 0:
                log.info("piecewise CUDA graphs: %d buckets of %d segments (%s tokens) captured in %.1f s; pool "
                         "%.0f MiB, device memory taken with the static buffers %.0f MiB", len(pw.counts),
                         self.model.num_segments, ",".join(map(str, pw.counts)), pw.capture_s,
                         pw.pool_bytes / 2**20, (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20)
        return pw

    def execute(self, step: StepInput) -> StepResult:
        """Queue one step's forward on this rank; on rank 0 also ship it to the workers first."""
        if self.rank == 0 and self.messages is not None:
            self.messages.send(step)
        n = len(step.input_ids)
        whole = self.graphs.fits(step)
        bucket = self.piecewise.bucket(n) if self.piecewise is not None and not whole else None
        if whole:
            logits = self.graphs.replay(step)
        elif bucket is not None:
            logits = self._forward_piecewise(step, bucket)
        else:
            logits = self._forward(step, self.kv_caches)
        # No device sync here: the error word is copied behind the step, and read once the host waits
        # for the step's tokens (`check_step`) or, at the latest, ErrorWatch.DEPTH steps on.
        slot = self.errors.after_step() if self.errors is not None else -1
        return StepResult(logits, whole or (bucket is not None and self.piecewise.capture), slot,
                          step.share_sampled)

    def sample(self, result: StepResult, batch: Optional[SamplingBatch]) -> StepResult:
        """Rank 0: sample `batch`'s rows of the step `result` came from (None: no sequence samples),
        share the tokens with the next step where it reads them on the device, and start their
        copy to the host without waiting for it (`result.ready` fires once it is there)."""
        draw = None
        if batch is not None:
            logits = result.logits
            # A decode batch samples every row: no index tensor to build and copy over.
            sel = logits if batch.rows == list(range(logits.shape[0])) else \
                logits[torch.tensor(batch.rows, device=logits.device)]
            draw = sample_on_device(sel, batch.params, batch.generators, self.generator, state=batch.state,
                                    state_rows=batch.state_rows, token_bitmask=batch.token_bitmask,
                                    masked=batch.masked, banned=batch.banned)
        if result.share_sampled:
            self.sampled.share(draw.tokens if draw is not None else torch.empty(0, dtype=torch.int64,
                                                                                device=self.device))
        result.draw, result.ready = _to_host(draw)
        result.logits = None   # sampled: the engine holds its prompt-logit slices, if any, not the rest
        return result

    def check_step(self, slot: int) -> None:
        """After waiting for a step's tokens: raise if a kernel of that step gave up on a peer."""
        if self.errors is not None:
            self.errors.check(slot)

    def worker_loop(self) -> None:
        while True:
            step = self.messages.recv()
            if step is None:
                return
            self.execute(step)
            if step.share_sampled:
                self.sampled.receive()

    def stop_workers(self) -> None:
        if self.rank == 0 and self.messages is not None:
            self.messages.send(None)


def _to_host(s: Optional[Sampled]) -> tuple:
    """Start the device-to-host copies of a draw without waiting for them: (host copy, event or None).
    One event after all the copies: once it fires, every field is there."""
    if s is None or s.tokens.device.type != "cuda":
        return s, None

    def copy(t):
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    host = Sampled(copy(s.tokens), copy(s.logprobs), copy(s.top_ids), copy(s.top_logprobs))
    ev = torch.cuda.Event()
    ev.record()
    return host, ev
