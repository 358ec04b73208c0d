"""The `tp_overlap` flag as one plan, resolved once per rank.

Everything the flag decides before a step runs, in one object made from the options
(`TPOverlapOptions`), the device's name, the TP size and the model:

  * the dispatch table, read here and nowhere else (Dispatcher.load), with `fused_ops: auto` resolved
    to the design the table's verdict chose (Dispatcher.for_design);
  * that design's AG-GEMM and GEMM-RS classes (ops/ag_gemm.py + ops/gemm_rs.py, or ops/chunked.py):
    the only place where the design's name is compared;
  * the byte limits: the all-reduce's capacity (`max_bytes`, 8 MiB by default) and the heap per rank
    (`heap_bytes`: the option's size, or what the layers need);
  * which steps above the engine's graph token limit run in piecewise graphs (`graph_step`).

Who makes it: each rank of our engine once (serving/worker/layer_factory.make_overlap_plan: rank 0 before it
spawns the others, so that a process that cannot run the kernels refuses before anything starts), and
vLLM's adapter once per TP group (vllm_plugin.py). The layers (overlap_layers.OverlapTPLayers), the
model runner and the piecewise graphs take the plan; none of them reads the options or the table again.

Making a plan imports no kernel: Triton must not be imported before the CPU's interpreter check
(runtime.use_triton_interpreter), which needs the plan's table to know whether any kernel runs. The
op classes are imported when the layers first ask for them.
"""

from __future__ import annotations

from typing import Iterable, Optional

from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.options import TPOverlapOptions


def design_ops(design: str) -> tuple[type, type]:
    """(AG-GEMM class, GEMM-RS class) of a fused-op design (options.DESIGNS): the one-launch kernels
    (ops/ag_gemm.py, ops/gemm_rs.py) or the chunked ops (ops/chunked.py). Imported when asked."""
    if design == "chunked":
        from tp_overlap_plugin.ops.chunked import ChunkedAllGatherGemm, ChunkedGemmReduceScatter
        return ChunkedAllGatherGemm, ChunkedGemmReduceScatter
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
    from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter
    return AllGatherGemm, GemmReduceScatter


class OverlapPlan:
    """The flag's choices for one rank. `dispatcher`: a table already in hand (tests, tune's own
    tables); without one the table this device and TP size run on is read here."""

    def __init__(self, options: TPOverlapOptions, device_name: str, world: int, model: Optional[str] = None,
                 dispatcher: Optional[Dispatcher] = None):
        self.options = options
        self.device_name = device_name
        self.world = world
        self.model = model
        if dispatcher is None:
            dispatcher = Dispatcher.load(options.dispatch, device_name, world, options.dispatch_table, model=model)
        # "auto": the table's design (its verdict chose it); an explicit other design drops the table's
        # fused-op rows and verdict, which were timed on ops this rank will not run
        self.dispatcher = dispatcher.for_design(options.fused_ops)
        self.design = self.dispatcher.fused_ops
        # the one comparison of the design's name: the chunked ops copy with the copy engine beside the
        # vendor GEMM, ~20 host operations a call, and so lose eagerly where the one-launch kernels do not
        self.chunked = self.design == "chunked"

    def __repr__(self) -> str:
        return (f"OverlapPlan({self.device_name}, TP={self.world}, dispatch={self.options.dispatch}, "
                f"design={self.design}, table: {self.dispatcher.source})")

    # ---- the design's ops ---------------------------------------------------------------------------
    @property
    def ag_gemm(self) -> type:
        """The AG-GEMM class the sequence-parallel layout's column layers run."""
        return design_ops(self.design)[0]

    @property
    def gemm_rs(self) -> type:
        """The GEMM-RS class the sequence-parallel layout's row layers run."""
        return design_ops(self.design)[1]

    # ---- byte limits --------------------------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        """The all-reduce's capacity: larger messages take the stock all-reduce."""
        return self.options.max_bytes

    def heap_bytes(self, need: int) -> int:
        """The heap per rank for layers that allocate `need` bytes of it (TPOverlapOptions.heap_bytes)."""
        return self.options.heap_bytes(need)

    def all_reduce_heap_bytes(self) -> int:
        """The heap of vLLM's layer swap: the all-reduce's buffers alone."""
        return self.options.all_reduce_heap_bytes(self.world)

    # ---- steps --------------------------------------------------------------------------------------
    def graph_step(self, tokens: int, ops: Iterable[tuple[str, int, int]]) -> bool:
        """Whether a step of `tokens` above the engine's graph token limit runs in a piecewise graph
        (serving/worker/piecewise.large_buckets), in a model whose linear ops are `ops`: where the table
        and its verdict run it with the chunked ops in the sharded layout (their host work loses
        eagerly); every other such step runs eagerly, as the stock engine's."""
        if self.world == 1 or not self.chunked:
            return False
        key = tuple(sorted(ops))
        return (self.dispatcher.step_runs(tokens, key) == "flag"
                and self.dispatcher.sequence_parallel(-(-tokens // self.world) * self.world, key))

    def startup_warnings(self, ops: Iterable[tuple[str, int, int]] = ()) -> list[str]:
        """What the start-up logs about the table: Dispatcher.startup_warnings for this rank."""
        return self.dispatcher.startup_warnings(self.device_name, self.world, ops, model=self.model)
