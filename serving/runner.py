"""Model runner: one per rank. Holds the model shard and the KV cache, turns a step into logits.

Rank 0 owns the scheduler; it broadcasts each `StepInput`, packed into one int64 tensor (see
`StepMessage`), over a gloo group, and every rank, itself included, builds the same tensors and runs
the same forward. Only collectives inside the TP layers connect the forwards.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tp_overlap_plugin import runtime
from tp_overlap_plugin.layers import TPGroup, TPLayers

from .attention import AttnMeta
from .piecewise import PiecewiseGraphs, default_token_counts
from .step_layout import Staging, layout
from .config import EngineConfig, ModelConfig, default_device, resolve_model_dir
from .model import CausalLM
from . import weights as W

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepInput:
    """A step, per sequence: every token's position and cache slot follow from q_lens, context_lens
    and block_tables (serving/step_layout.py), so they are neither built nor sent token by token."""
    input_ids: list[int]
    q_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    logit_rows: list[int]     # token rows whose logits the step must return
    # Async scheduling: after this step rank 0 broadcasts its sampled ids into every rank's `sampled`.
    share_sampled: bool = False
    # An input id -(k + 1) stands for the k-th token sampled by the previous step, which is still on
    # the device when this step is launched (async scheduling): every rank holds it in `sampled`.


class StepMessage:
    """A step (or the stop command) as one flat int64 tensor, so that no Python object is pickled per
    step. Layout: a header [command, tokens, sequences, decodes, logit rows, flags, body length], then the
    body: input ids (one per token), q lens, context lens, table lengths (one per sequence), logit rows,
    and the block tables back to back. Tables are sent ragged: at batch 256 a padded matrix would be
    mostly padding.

    The message travels in a fixed buffer of CAPACITY entries, which holds a decode step of up to ~100
    sequences at a few-thousand-token context; a longer one sends its tail in a second broadcast of a
    length both sides read from the header. Rank 0 broadcasts asynchronously and only waits for the
    transfer when it needs the buffer again (two of them alternate), so its own launch never waits on
    gloo."""

    HEADER = 7
    CAPACITY = 4096
    STEP, STOP = 1, 2
    SHARE_SAMPLED = 1   # flags

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.bufs = [torch.zeros(self.CAPACITY, dtype=torch.int64) for _ in range(2)]
        self.pending: list = [None, None]      # rank 0: the broadcasts still reading each buffer
        self.turn = 0

    @classmethod
    def encode(cls, step: Optional[StepInput]) -> list[int]:
        if step is None:
            return [cls.STOP, 0, 0, 0, 0, 0, 0]
        body = list(itertools.chain(step.input_ids, step.q_lens, step.context_lens, map(len, step.block_tables),
                                    step.logit_rows, itertools.chain.from_iterable(step.block_tables)))
        flags = cls.SHARE_SAMPLED if step.share_sampled else 0
        return [cls.STEP, len(step.input_ids), len(step.q_lens), step.num_decodes, len(step.logit_rows), flags,
                len(body)] + body

    @classmethod
    def decode(cls, msg: list[int]) -> Optional[StepInput]:
        cmd, n, s, nd, r, flags, _ = msg[:cls.HEADER]
        if cmd == cls.STOP:
            return None
        if cmd != cls.STEP:
            raise RuntimeError(f"step message with unknown command {cmd}: the ranks are out of step")
        it = iter(msg[cls.HEADER:])
        take = lambda k: list(itertools.islice(it, k))   # noqa: E731
        ids, q_lens, ctx, widths, rows = take(n), take(s), take(s), take(s), take(r)
        return StepInput(ids, q_lens, ctx, [take(w) for w in widths], nd, rows,
                         bool(flags & cls.SHARE_SAMPLED))

    def send(self, step: Optional[StepInput]) -> None:
        msg = self.encode(step)
        i = self.turn
        self.turn ^= 1
        for work in self.pending[i] or ():
            work.wait()
        buf, cap = self.bufs[i], self.CAPACITY
        head = msg[:cap]
        buf[:len(head)] = torch.tensor(head, dtype=torch.int64)
        works = [dist.broadcast(buf, src=0, group=self.group, async_op=True)]
        if len(msg) > cap:
            tail = torch.tensor(msg[cap:], dtype=torch.int64)
            works.append(dist.broadcast(tail, src=0, group=self.group, async_op=True))
        self.pending[i] = works
        if step is None:
            self.flush()

    def flush(self) -> None:
        for i, works in enumerate(self.pending):
            for work in works or ():
                work.wait()
            self.pending[i] = None

    def recv(self) -> Optional[StepInput]:
        buf, cap = self.bufs[0], self.CAPACITY
        dist.broadcast(buf, src=0, group=self.group)
        total = self.HEADER + int(buf[self.HEADER - 1])
        msg = buf[:min(total, cap)].tolist()
        if total > cap:
            tail = torch.empty(total - cap, dtype=torch.int64)
            dist.broadcast(tail, src=0, group=self.group)
            msg += tail.tolist()
        return self.decode(msg)


@triton.jit(do_not_specialize=["n"])   # the step's token count: one variant for every step
def _resolve_refs_kernel(ids_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    """ids[i] = sampled[-ids[i] - 1] where ids[i] < 0 (see StepInput), in one launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    ref = ids < 0
    got = tl.load(sampled_ptr + tl.maximum(-ids - 1, 0), mask=mask & ref, other=0)
    tl.store(ids_ptr + offs, tl.where(ref, got, ids), mask=mask)


class ErrorWatch:
    """The heap's error word (a spin-wait that gave up on a peer writes it), read without holding the
    host until the device has caught up.

    After each step a copy of the word into pinned memory is queued behind the step's work, in a ring
    of DEPTH slots. `check(slot)` reads the step's copy once the host has waited for that step anyway
    (rank 0: its sampled tokens, copied after it), so a failed step raises before any token it
    produced is used. `after_step` also reads the copy of the step DEPTH steps back, waiting for it
    if need be: a rank that never waits on its tokens (a worker) raises at most DEPTH steps late, and
    never runs more than DEPTH steps ahead of its device.

    Without a device to wait for (the CPU, unless `lagged`), every step checks the word directly."""

    DEPTH = 4

    def __init__(self, heap, lagged: Optional[bool] = None):
        self.heap = heap
        self.lagged = heap.error.device.type == "cuda" if lagged is None else lagged
        self.cuda = heap.error.device.type == "cuda"
        self.steps = 0
        if self.lagged:
            host = torch.zeros(self.DEPTH, dtype=torch.int64)
            self.host = host.pin_memory() if self.cuda else host
            self.view = self.host.numpy()
            self.events: list = [None] * self.DEPTH
            self.queued = [False] * self.DEPTH

    def _read(self, slot: int) -> None:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        if self.view[slot] != 0:
            self.heap.check()   # reads the whole error record (a sync, on the way to an exception)

    def after_step(self) -> int:
        """Queue this step's copy of the error word; returns its slot for `check`."""
        if not self.lagged:
            self.heap.check()
            return -1
        slot = self.steps % self.DEPTH
        self.steps += 1
        if self.queued[slot]:
            self._read(slot)
        self.host[slot:slot + 1].copy_(self.heap.error[:1], non_blocking=True)
        self.queued[slot] = True
        if self.cuda:
            if self.events[slot] is None:
                self.events[slot] = torch.cuda.Event()
            self.events[slot].record()
        return slot

    def check(self, slot: int) -> None:
        """Raise RankTimeoutError if the step of `slot` (or an earlier one) failed. Call it once the
        host has waited for that step's results: then it waits for nothing."""
        if slot >= 0:
            self._read(slot)


def resolve_dtype(cfg: EngineConfig, mcfg: ModelConfig, device: str) -> torch.dtype:
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if device == "cpu":
        return torch.float32
    return _DTYPES.get(str(mcfg.torch_dtype).replace("torch.", ""), torch.bfloat16) \
        if mcfg.torch_dtype in ("bfloat16", "float16") else torch.bfloat16


def require_triton_interpreter(cfg: EngineConfig, device_type: str, world_size: int) -> bool:
    """With the flag on the CPU, the overlap kernels can only run under the Triton interpreter.
    Checked at start-up (before workers are spawned, and on each rank before its heap is built),
    so that a process which cannot run them refuses to start instead of failing its first request.
    Returns whether the kernels will be interpreted."""
    if not (cfg.overlap_enabled and device_type == "cpu"):
        return False
    from tp_overlap_plugin.dispatch import Dispatcher

    oc = cfg.tp_overlap
    if not Dispatcher.load(oc.dispatch, "cpu", world_size, oc.dispatch_table).may_use_kernels:
        return False
    if runtime.use_triton_interpreter():
        return True
    raise RuntimeError(
        "tp_overlap on the CPU runs its Triton kernels under the Triton interpreter, but this process "
        "imported Triton without it, and Triton cannot switch afterwards. Start the process with "
        "TRITON_INTERPRET=1 in its environment (e.g. `TRITON_INTERPRET=1 python script.py`; the "
        "`tp-overlap` command sets it by itself on a machine without a GPU unless the environment "
        "sets it), or turn the flag off.")


def resolve_max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    if cfg.max_model_len is None:
        return mcfg.max_position_embeddings
    if cfg.max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings="
                         f"{mcfg.max_position_embeddings}")
    return cfg.max_model_len


class ModelRunner:
    def __init__(self, cfg: EngineConfig, rank: int, world_size: int, group, ctrl_group, device: torch.device):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.group, self.ctrl_group = group, ctrl_group
        self.device = device
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(world_size)
        self.max_model_len = resolve_max_model_len(cfg, self.mcfg)
        self.dtype = resolve_dtype(cfg, self.mcfg, device.type)
        self.block_size = cfg.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)

        self.heap = None
        tp = self._layer_factory(TPGroup(rank, world_size, group))
        with torch.device(device):
            self.model = CausalLM(self.mcfg, tp, self.max_model_len).eval()
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
        self.last_error_slot = -1     # the ErrorWatch slot of the latest step (see `execute`)
        self.last_graph = False       # whether the latest step replayed CUDA graphs (whole or piecewise)
        self.graphs: dict[int, tuple] = {}
        self.max_graph_bs = 0
        self.piecewise: Optional[PiecewiseGraphs] = None
        self.messages = StepMessage(ctrl_group, rank) if world_size > 1 else None
        self.sampled = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=device)

        self.num_blocks = self._agree(self._kv_blocks_budget())
        # One extra physical block that the block manager never hands out: padded CUDA-graph rows write there.
        self.scratch_block = self.num_blocks
        kv_heads = self.mcfg.num_kv_heads // world_size
        shape = (self.num_blocks + 1, self.block_size, kv_heads, self.mcfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=device),
                           torch.zeros(shape, dtype=self.dtype, device=device))
                          for _ in range(self.mcfg.num_layers)]
        if self.heap is not None and device.type == "cuda":
            self._warm_overlap_shapes()
        graphs = device.type == "cuda" and not cfg.enforce_eager
        # One pool for every graph, the largest piecewise bucket first: a replay never overlaps another.
        self.graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        if graphs and cfg.piecewise_cuda_graphs:
            self.piecewise = self._piecewise(capture=True)
        if graphs:
            self._capture_graphs()

    def release(self) -> None:
        """Drop the KV cache and graphs (the big allocations) once the engine is shut down."""
        self.graphs.clear()
        self.piecewise = None
        self.kv_caches = []
        if self.heap is not None:
            self.heap.close()
            self.heap = None

    def _layer_factory(self, tp: TPGroup) -> TPLayers:
        """The `tp_overlap` flag's one switch: stock layers, or the overlap factory over a heap."""
        if not self.cfg.overlap_enabled:
            return TPLayers(tp, self.dtype, self.device)
        from tp_overlap_plugin.dispatch import Dispatcher
        from tp_overlap_plugin.heap import SymmetricHeap
        from tp_overlap_plugin.overlap_layers import OverlapTPLayers, required_heap_bytes
        interpreted = require_triton_interpreter(self.cfg, self.device.type, self.world_size)
        oc = self.cfg.tp_overlap
        max_tokens = max(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        dispatcher = Dispatcher.load(oc.dispatch, name, self.world_size, oc.dispatch_table, model=self.cfg.model)
        if self.world_size == 1:
            # nothing to communicate, so no heap: the flag's layers run the local matmuls alone (the
            # decode matmul where the table's gemv rows pick it, F.linear elsewhere)
            self._log_dispatch(dispatcher, name, "no heap at TP=1", interpreted)
            return OverlapTPLayers(tp, self.dtype, self.device, None, max_tokens, dispatcher, oc.max_bytes)
        needed = required_heap_bytes(self.mcfg.hidden_size, max_tokens, self.world_size, self.dtype, oc.max_bytes)
        size = oc.heap_bytes(needed)
        try:
            # ranks sharing a GPU map each other's heaps through IPC handles (as multirank.run_ranks)
            backend = oc.backend or ("ipc" if self.device.type == "cuda" and shares_gpus(self.world_size) else None)
            self.heap = SymmetricHeap(self.ctrl_group, self.device, size, backend=backend, timeout_s=oc.heap_timeout_s)
        except Exception as e:
            if oc.heap_size:
                # The user's own size failed: telling them to set it would be no advice.
                advice = (f"that is tp_overlap.heap_size={oc.heap_size}; lower it (this model needs about "
                          f"{needed / 2**20:.0f} MiB per rank at max_num_batched_tokens/max_num_seqs={max_tokens}) "
                          f"or free device memory")
            else:
                advice = (f"the size follows the step token budget, max(max_num_batched_tokens, max_num_seqs)="
                          f"{max_tokens}; lower those, or free device memory")
            raise RuntimeError(f"tp_overlap: could not allocate a {size / 2**20:.0f} MiB symmetric heap per rank "
                               f"on {self.device} ({e}); {advice}") from e
        self._log_dispatch(dispatcher, name, f"heap {size >> 20} MiB/rank (fused-op and all-reduce buffers for "
                           f"{max_tokens} tokens per step)", interpreted)
        return OverlapTPLayers(tp, self.dtype, self.device, self.heap, max_tokens, dispatcher, oc.max_bytes)

    def _log_dispatch(self, dispatcher, device_name: str, heap: str, interpreted: bool) -> None:
        """Rank 0 says once which tables the flag runs on and what they lack (tp_overlap_plugin/tables.py)."""
        if self.rank != 0:
            return
        from tp_overlap_plugin.gemm_config import table_source
        from tp_overlap_plugin.overlap import KERNEL_DTYPES
        from tp_overlap_plugin.tuning.shapes import ModelDims
        oc = self.cfg.tp_overlap
        log.info("tp_overlap: %s, dispatch %s (%s); GEMM configs: %s", heap, oc.dispatch, dispatcher.source,
                 table_source(self.device))
        if interpreted:
            log.info("tp_overlap: on the CPU the kernels run under the Triton interpreter "
                     "(TRITON_INTERPRET=1): correct, and slow")
        dims = ModelDims.of(self.mcfg)
        for w in dispatcher.startup_warnings(device_name, self.world_size,
                                             dims.layers(self.world_size) + [dims.lm_head(self.world_size)],
                                             model=self.cfg.model):
            log.warning(w)
        if dispatcher.missing is None and self.dtype not in KERNEL_DTYPES and dispatcher.may_use_kernels:
            log.warning("tp_overlap: the AG-GEMM and GEMM-RS kernels take %s only, so with dtype %s "
                        "those ops fall back to the stock path (all-gather / reduce-scatter, then torch "
                        "matmul); the all-reduce kernel does take it. Use --dtype bfloat16 to run them.",
                        " and ".join(str(d).replace("torch.", "") for d in KERNEL_DTYPES),
                        str(self.dtype).replace("torch.", ""))

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

    def _resolve_refs(self, ids: torch.Tensor) -> None:
        """Replace in place the ids that stand for tokens sampled by the previous step (see StepInput)."""
        if ids.device.type == "cuda":
            n = ids.numel()
            _resolve_refs_kernel[(triton.cdiv(n, 1024),)](ids, self.sampled, n, BLOCK=1024)
            return
        ref = (-ids - 1).clamp_(min=0)
        ids.copy_(torch.where(ids < 0, self.sampled.gather(0, ref), ids))

    def share_sampled(self, tokens: torch.Tensor) -> None:
        """Rank 0, async scheduling: this step's sampled ids, for the next step's input on every rank.
        Stays on the device; on GPUs the broadcast is queued on the stream like the forward."""
        self.sampled[:tokens.numel()].copy_(tokens)
        if self.world_size > 1:
            dist.broadcast(self.sampled, src=0, group=self.group)

    @torch.inference_mode()
    def _forward(self, step: StepInput, kv_caches) -> torch.Tensor:
        tokens, rows, meta, has_refs = self._step_tensors(step)
        ids, pos = tokens[0], tokens[1]
        if has_refs:
            self._resolve_refs(ids)
        hidden = self.model(ids, pos, meta, kv_caches)
        return self.model.compute_logits(hidden, rows)

    @torch.inference_mode()
    def _forward_piecewise(self, step: StepInput, bucket: int) -> torch.Tensor:
        tokens, rows, meta, _ = self._step_tensors(step, pad_to=bucket)
        hidden = self.piecewise.run(len(step.input_ids), bucket, tokens, meta)
        # the LM head on the rows asked for, eagerly: how many there are varies per step
        return self.model.compute_logits(hidden, rows)

    def _piecewise(self, capture: bool) -> PiecewiseGraphs:
        counts = self.cfg.piecewise_graph_token_counts or default_token_counts(self.cfg.max_num_batched_tokens)
        pw = PiecewiseGraphs(self.model, self.kv_caches, counts,
                             self.scratch_block * self.block_size, self._resolve_refs, capture, self.graph_pool)
        if capture:
            free0 = torch.cuda.mem_get_info(self.device)[0]
            pw.capture_all()
            if self.rank == 0:
                log.info("piecewise CUDA graphs: %d buckets of %d segments (%s tokens) captured in %.1f s; pool "
                         "%.0f MiB, device memory taken with the static buffers %.0f MiB", len(pw.counts),
                         self.model.num_segments, ",".join(map(str, pw.counts)), pw.capture_s,
                         pw.pool_bytes / 2**20, (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20)
        return pw

    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step on this rank; on rank 0 also ships it to the workers first."""
        if self.rank == 0 and self.messages is not None:
            self.messages.send(step)
        n = len(step.input_ids)
        whole = bool(self.graphs and step.num_decodes == n and n <= self.max_graph_bs
                     and step.logit_rows == list(range(n)))
        bucket = self.piecewise.bucket(n) if self.piecewise is not None and not whole else None
        self.last_graph = whole or (bucket is not None and self.piecewise.capture)
        if whole:
            logits = self._replay(step)
        elif bucket is not None:
            logits = self._forward_piecewise(step, bucket)
        else:
            logits = self._forward(step, self.kv_caches)
        if self.errors is not None:
            # No device sync here: the error word is copied behind the step, and read once the host
            # waits for the step's tokens (`check_step`) or, at the latest, ErrorWatch.DEPTH steps on.
            self.last_error_slot = self.errors.after_step()
        return logits

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
                dist.broadcast(self.sampled, src=0, group=self.group)   # rank 0's share_sampled

    def stop_workers(self) -> None:
        if self.rank == 0 and self.messages is not None:
            self.messages.send(None)

    # ---- CUDA graphs (decode only) ---------------------------------------------------------
    def _capture_graphs(self) -> None:
        limit = self.cfg.max_num_seqs
        sizes = self.cfg.cuda_graph_batch_sizes or ([1, 2, 4, 8] + list(range(16, 513, 16)))
        sizes = sorted({s for s in sizes if s <= limit} | ({limit} if limit <= 512 else set()))
        self.max_graph_bs = max(sizes)
        mb, dev, width = self.max_graph_bs, self.device, self.max_blocks_per_seq
        # The graphs read their inputs from two device buffers (int64: ids | positions | slots;
        # int32: context lens | block tables). A replay fills pinned host twins and copies them over
        # in three transfers, instead of a dozen small pageable copies and fills.
        self.h64 = torch.zeros((3, mb), dtype=torch.int64).pin_memory()
        self.h32 = torch.zeros((mb + mb * width,), dtype=torch.int32).pin_memory()
        self.h64[2].fill_(self.scratch_block * self.block_size)
        self.h32[:mb].fill_(1)
        self.h32[mb:].fill_(self.scratch_block)
        self.g64, self.g32 = self.h64.to(dev), self.h32.to(dev)
        self.g_ids, self.g_pos, self.g_slots = self.g64
        self.g_ctx, self.g_bt = self.g32[:mb], self.g32[mb:].view(mb, width)
        self.inputs_copied = torch.cuda.Event()
        self.inputs_copied.record()
        self.g_cu = torch.arange(mb + 1, dtype=torch.int32, device=dev)
        pool = self.graph_pool
        for bs in sorted(sizes, reverse=True):
            meta = AttnMeta(slot_mapping=self.g_slots[:bs], num_decodes=bs, cu_seqlens_q=self.g_cu[:bs + 1],
                            context_lens=self.g_ctx[:bs], block_tables=self.g_bt[:bs], max_q_len=1,
                            use_triton=True)

            def run():
                # Ids of tokens sampled by the step before (async scheduling) are resolved inside the
                # graph: no extra launches between two replays. A step without such ids is unchanged.
                self._resolve_refs(self.g_ids[:bs])
                h = self.model(self.g_ids[:bs], self.g_pos[:bs], meta, self.kv_caches)
                return self.model.compute_logits(h, None)   # every row of a decode batch samples

            with torch.inference_mode():
                run()  # compiles the Triton kernels and warms the allocator outside the capture
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = run()
            pool = g.pool()
            self.graphs[bs] = (g, out)
        torch.cuda.synchronize(dev)

    def _replay(self, step: StepInput) -> torch.Tensor:
        n = len(step.input_ids)
        bs = next(s for s in sorted(self.graphs) if s >= n)
        mb, width = self.max_graph_bs, self.max_blocks_per_seq
        self.inputs_copied.synchronize()  # the previous replay's transfer has read the host buffers
        h64, ctx, bt = self.h64.numpy(), self.h32[:mb].numpy(), self.h32[mb:].view(mb, width).numpy()
        bt[n:bs] = self.scratch_block
        lay = layout(step.q_lens, step.context_lens, step.block_tables, self.block_size, self.scratch_block,
                     width, bt[:n])
        h64[0, :n], h64[1, :n], h64[2, :n] = step.input_ids, lay.positions, lay.slots
        h64[0, n:bs], h64[1, n:bs], h64[2, n:bs] = 0, 0, self.scratch_block * self.block_size
        ctx[:n], ctx[n:bs] = step.context_lens, 1
        self.g64.copy_(self.h64, non_blocking=True)  # all of it: 24 bytes a row, one contiguous transfer
        self.g_ctx[:bs].copy_(self.h32[:bs], non_blocking=True)
        self.g_bt[:bs].copy_(self.h32[mb:mb + bs * width].view(bs, width), non_blocking=True)
        self.inputs_copied.record()
        g, out = self.graphs[bs]
        g.replay()
        return out[:n]


def init_distributed(cfg: EngineConfig, rank: int, world_size: int, store=None,
                     local_rank: Optional[int] = None):
    """Join (or reuse) the default process group; returns (device, model group, control group)."""
    dev_kind = default_device(cfg)
    if dev_kind == "cuda":
        lr = rank if local_rank is None else local_rank
        if shares_gpus(world_size):
            # correctness checks only (ranks on one GPU are time-sliced): rank r on GPU r % count, as
            # in multirank.run_ranks. NCCL refuses two ranks of a communicator on one GPU unless they
            # claim different hosts; then it connects them through its socket transport.
            lr %= torch.cuda.device_count()
            if not dist.is_initialized():
                os.environ["NCCL_HOSTID"] = f"tp-overlap-shared-gpu-rank-{rank}"
        torch.cuda.set_device(lr)
        device = torch.device("cuda", lr)
    else:
        device = torch.device("cpu")
    if world_size == 1 and not dist.is_initialized():
        return device, None, None
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                      timeout=timedelta(seconds=cfg.dist_timeout_s))
        if store is not None:
            kwargs["store"] = store
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    if dist.get_world_size() != cfg.tensor_parallel_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but tensor_parallel_size="
                         f"{cfg.tensor_parallel_size}; run one process per TP rank")
    group = dist.group.WORLD
    ctrl = group if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return device, group, ctrl


def shares_gpus(world_size: int) -> bool:
    """Whether this engine's ranks share GPUs: TP_OVERLAP_SHARE_GPUS=1 and fewer GPUs than ranks."""
    from tp_overlap_plugin.multirank import sharing_gpus
    return sharing_gpus() and torch.cuda.device_count() < world_size


def destroy_group_bounded(timeout: float = 30.0) -> bool:
    """dist.destroy_process_group(), given up on after `timeout` s. NCCL's teardown talks to the
    peers: on H200x2 a rank-0 destroy that started after the workers had exited never returned.
    So every rank leaves at the same time (rank 0 right after telling the workers to stop) and
    none waits forever: the call runs on a daemon thread that process exit abandons."""
    t = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("torch.distributed teardown did not finish within %.0f s; leaving without it", timeout)
        return False
    return True


def worker_main(cfg_json: str, rank: int, world_size: int, host: str, port: int, err_queue=None) -> None:
    """Entry point of a spawned worker rank: build the runner, then serve steps until told to stop."""
    try:
        cfg = EngineConfig.model_validate_json(cfg_json)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=timedelta(seconds=cfg.dist_timeout_s))
        # Rank 0 waits for this key while watching our pid, so a worker that dies before this point
        # (bad import, bad config) is reported instead of leaving rank 0 waiting in a rendezvous.
        store.set(f"worker_ready/{rank}", "1")
        device, group, ctrl = init_distributed(cfg, rank, world_size, store)
        runner = ModelRunner(cfg, rank, world_size, group, ctrl, device)
        runner.worker_loop()
        runner.release()  # graphs hold NCCL work: gone before the communicator is
    except BaseException as e:  # surfaced to rank 0, which would otherwise only see a closed socket
        if err_queue is not None:
            err_queue.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        if dist.is_initialized():
            destroy_group_bounded()
