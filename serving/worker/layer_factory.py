"""The `tp_overlap` flag's one switch in the engine: each rank's plan (tp_overlap_plugin/overlap_plan.py,
made once per rank), then the stock TP layers, or the plan's overlap factory over a symmetric heap sized
for the step token budget; and what rank 0 says at start-up about the tables the flag runs on."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from tp_overlap_plugin import runtime
from tp_overlap_plugin.layers import TPGroup, TPLayers
from tp_overlap_plugin.overlap_plan import OverlapPlan

from ..config import EngineConfig, ModelConfig
from .distributed import shares_gpus

log = logging.getLogger(__name__)


def make_overlap_plan(cfg: EngineConfig, device: torch.device, world: int) -> Optional[OverlapPlan]:
    """This rank's plan for the flag (None: the flag is off): made once per rank, before its layers,
    and on rank 0 before the other ranks are spawned, so that a process that cannot run the kernels
    refuses to start instead of failing its first request (require_triton_interpreter)."""
    if not cfg.overlap_enabled:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    plan = OverlapPlan(cfg.tp_overlap, name, world, model=cfg.model)
    require_triton_interpreter(plan, device.type)
    return plan


def require_triton_interpreter(plan: OverlapPlan, device_type: str) -> bool:
    """With the flag on the CPU, the overlap kernels can only run under the Triton interpreter.
    Returns whether the kernels will be interpreted; raises where they would run and cannot."""
    if device_type != "cpu" or not plan.dispatcher.may_use_kernels:
        return False
    if runtime.use_triton_interpreter():
        return True
    raise RuntimeError(
        "tp_overlap on the CPU runs its Triton kernels under the Triton interpreter, but this process "
        "imported Triton without it, and Triton cannot switch afterwards. Start the process with "
        "TRITON_INTERPRET=1 in its environment (e.g. `TRITON_INTERPRET=1 python script.py`; the "
        "`tp-overlap` command sets it by itself on a machine without a GPU unless the environment "
        "sets it), or turn the flag off.")


def make_layers(cfg: EngineConfig, plan: Optional[OverlapPlan], mcfg: ModelConfig, tp: TPGroup, ctrl_group,
                device: torch.device, dtype: torch.dtype) -> tuple[TPLayers, Optional[object]]:
    """(the layer factory, its symmetric heap or None): the stock layers without a plan, else the
    plan's. Collective with the flag at TP > 1: every rank builds its heap together over `ctrl_group`."""
    if plan is None:
        return TPLayers(tp, dtype, device), None
    from tp_overlap_plugin.heap import SymmetricHeap
    from tp_overlap_plugin.overlap_layers import OverlapTPLayers, required_heap_bytes
    world = tp.world_size
    interpreted = require_triton_interpreter(plan, device.type)
    oc = plan.options
    max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    if world == 1:
        # nothing to communicate, so no heap: the flag's layers run the local matmuls alone (the
        # decode matmul where the table's gemv rows pick it, F.linear elsewhere)
        _log_dispatch(plan, mcfg, tp, device, dtype, "no heap at TP=1", interpreted)
        return OverlapTPLayers(tp, dtype, device, None, max_tokens, plan), None
    needed = required_heap_bytes(plan, mcfg.hidden_size, max_tokens, dtype)
    size = plan.heap_bytes(needed)
    try:
        # ranks sharing a GPU map each other's heaps through IPC handles (as multirank.run_ranks)
        backend = oc.backend or ("ipc" if device.type == "cuda" and shares_gpus(world) else None)
        heap = SymmetricHeap(ctrl_group, device, size, backend=backend, timeout_s=oc.heap_timeout_s)
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
                           f"on {device} ({e}); {advice}") from e
    _log_dispatch(plan, mcfg, tp, device, dtype, f"heap {size >> 20} MiB/rank (fused-op and "
                  f"all-reduce buffers for {max_tokens} tokens per step)", interpreted)
    return OverlapTPLayers(tp, dtype, device, heap, max_tokens, plan), heap


def _log_dispatch(plan: OverlapPlan, mcfg: ModelConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype,
                  heap: str, interpreted: bool) -> None:
    """Rank 0 says once which tables the flag runs on and what they lack (tp_overlap_plugin/tables/)."""
    if tp.rank != 0:
        return
    from tp_overlap_plugin.gemm_config import table_source
    from tp_overlap_plugin.ops.operands import KERNEL_DTYPES
    from tp_overlap_plugin.shapes import ModelDims
    dispatcher, world = plan.dispatcher, tp.world_size
    log.info("tp_overlap: %s, dispatch %s (%s); GEMM configs: %s", heap, plan.options.dispatch, dispatcher.source,
             table_source(device))
    if interpreted:
        log.info("tp_overlap: on the CPU the kernels run under the Triton interpreter "
                 "(TRITON_INTERPRET=1): correct, and slow")
    dims = ModelDims.of(mcfg)
    for w in plan.startup_warnings(dims.layers(world) + [dims.lm_head(world)]):
        log.warning(w)
    if dispatcher.missing is None and dtype not in KERNEL_DTYPES and dispatcher.may_use_kernels:
        log.warning("tp_overlap: the AG-GEMM and GEMM-RS kernels take %s only, so with dtype %s "
                    "those ops fall back to the stock path (all-gather / reduce-scatter, then torch "
                    "matmul); the all-reduce kernel does take it. Use --dtype bfloat16 to run them.",
                    " and ".join(str(d).replace("torch.", "") for d in KERNEL_DTYPES),
                    str(dtype).replace("torch.", ""))
