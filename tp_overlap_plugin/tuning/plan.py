"""What one `tp-overlap tune` run measures: per phase its items (each a dict with its row's key in the
store), the configs it tries, the heap its ranks need, and the time it is estimated to take."""

from __future__ import annotations

from dataclasses import dataclass, field

from tp_overlap_plugin import tables
from tp_overlap_plugin.shapes import LAYER_OPS, ModelDims

# in this order: a phase's table is written before the phases that run on it (the decode matmul's
# configs before gemv, the GEMM core's before the phases that run the core)
PHASES = ("gemm_configs", "decode_configs", "gemv", "silu_mul", "all_reduce", "fused_ops", "gemm_ar")
# what `tune --only` can pick: a measuring phase, or the engine's check (tuning/engine_check.py)
ONLY_CHOICES = (*PHASES, "engine")
# what `tune --shapes` measures: "model", the shard shapes of --model at --tp (every phase); "shipped",
# those of every model config shipped with the engine at TP = 1, 2, 4, 8 (the per-device config tables'
# phases, store.DEVICE_PHASES, alone: what a shipped gemm_tables/ or decode_tables/ file holds)
SHAPES = ("model", "shipped")
SHARED_OUT = ("gemm_configs", "decode_configs", "gemv", "silu_mul")  # one GPU's work: shared over the ranks
GPU_REPEATS = 3
# seconds per measured item, for the estimate printed first. GPU: gemm_configs and gemv from the H100
# runs of 2026-11-24 (TP=1, Llama-3-8B: 28 + 20 rows in 150 s, 18 s of it the preflight); the
# collective phases are guesses from runs of bench/overlap.py and the retired foundation.py and
# gemm_ar.py on H200x2, decode_configs and silu_mul from the retired decode_configs.py and
# gemm_silu_mul.py (not yet timed as tune runs; bench/notes/tune.md has the cost model). CPU: the
# interpreter at the CPU plan's sizes.
SECONDS_PER_ITEM = {
    "cuda": {"gemm_configs": 1.5, "decode_configs": 3.0, "gemv": 3.3, "silu_mul": 2.0, "all_reduce": 2.0,
             "fused_ops": 2.5, "gemm_ar": 3.0},
    "cpu": {"gemm_configs": 0.5, "decode_configs": 1.5, "gemv": 0.3, "silu_mul": 2.0, "all_reduce": 1.0,
            "fused_ops": 2.0, "gemm_ar": 4.0},
}
START_SECONDS = {"cuda": 40.0, "cpu": 8.0}  # rank start-up, and on GPUs the configs' preflight compile
# the engine phase (tuning/engine_check.py): its ranks' start and both engines' builds (dummy weights,
# kernel warm-up, CUDA graphs), then per step size two engines x repeats x ~TARGET_S of steps plus the
# warm-up steps. Guesses until a GPU run times them (bench/notes/tune.md); CPU: the demo model.
ENGINE_START_SECONDS = {"cuda": 60.0, "cpu": 10.0}
ENGINE_SECONDS_PER_ITEM = {"cuda": 4.0, "cpu": 8.0}
# one more engine built per design measured, and one for the replicated layout (engine_check.engine_rank)
ENGINE_BUILD_SECONDS = {"cuda": 30.0, "cpu": 8.0}


@dataclass(frozen=True)
class Plan:
    """What one run measures: per phase its items (each a dict with the row's key); "engine": the
    step sizes of the engine's check (tuning/engine_check.py)."""
    model: str              # its name in the tables (a directory's last part); "shipped": shipped_plan
    model_spec: str         # what the engine loads: a shipped config name, a directory, "demo"
    dims: ModelDims | None  # (None: the shipped models' shapes, every one's own)
    world: int
    device: str
    quick: bool
    repeats: int
    margin: float
    engine_margin: float
    items: dict = field(default_factory=dict)
    # the sequence-parallel layout's AG-GEMM / GEMM-RS designs the fused_ops phase and the engine's verdict
    # measure (options.DESIGNS; one where `tune --fused-ops` names it): the verdict chooses one, and the
    # table holds that design's rows and says which
    designs: tuple = ("kernel", "chunked")
    shapes: str = "model"   # SHAPES

    @property
    def command(self) -> str:
        """The command that measures this plan's shapes again (the config tables name it)."""
        return tables.tune_command(self.world, self.model, shapes=self.shapes)

    def describe(self) -> str:
        """What the run measures, for its first line."""
        if self.shapes == "model":
            return f"{self.model} at TP={self.world}"
        from tp_overlap_plugin.tuning.shapes import SHIPPED_TPS, shipped_names
        return (f"the shapes of every shipped model ({', '.join(shipped_names())}) at TP="
                f"{','.join(map(str, SHIPPED_TPS))}, shared over {self.world} rank(s)")

    @property
    def fused_ops(self) -> str:
        """What `tune --fused-ops` was given: "auto" (every design), or the one design."""
        return self.designs[0] if len(self.designs) == 1 else "auto"

    def estimate_s(self) -> float:
        return sum(self.phase_estimates_s().values())

    def phase_estimates_s(self) -> dict:
        """Seconds per phase (and the ranks' start), by SECONDS_PER_ITEM: the single-GPU phases are
        shared out over the ranks."""
        per, dev = SECONDS_PER_ITEM[self.device], self.device
        out = {"start": START_SECONDS[dev]}
        out.update({p: per[p] * len(self.items[p]) / (self.world if p in SHARED_OUT else 1)
                    for p in PHASES if self.items.get(p)})
        if self.items.get("engine"):
            out["engine"] = (ENGINE_START_SECONDS[dev] + ENGINE_BUILD_SECONDS[dev] * (len(self.designs) + 1)
                             + ENGINE_SECONDS_PER_ITEM[dev] * len(self.items["engine"]) * (len(self.designs) + 1))
        return out


def _by_shape(shapes: dict, ms) -> list[dict]:
    """Items per M and distinct local matmul (K, N), each naming the layers of that shape (`shapes`:
    gemm_configs.problem_shapes)."""
    return [{"key": f"{m}x{k}x{n}", "M": m, "K": k, "N": n, "names": names}
            for m in ms for (k, n), names in shapes.items()]


def _config_items(models: dict, gpu: bool, quick: bool) -> dict:
    """The config tables' phases (store.DEVICE_PHASES) on the shapes of `models` ({label: (ModelDims, TP
    sizes)}): the GEMM core at its M passes, the decode matmul at the decode rows (the LM head too)."""
    from tp_overlap_plugin.tuning import gemm_configs, gemv
    if gpu:
        passes, rows = ((8192, 1024, 64, 1) if quick else gemm_configs.M_PASSES), gemv.decode_rows(quick)
    else:  # the interpreter: one size each (both decode-matmul paths take 4 rows)
        passes, rows = (16,), (4,)
    return {"gemm_configs": _by_shape(gemm_configs.problem_shapes(models), passes),
            "decode_configs": _by_shape(gemm_configs.problem_shapes(models, lm_head=True), rows)}


def shipped_plan(world: int, device: str, quick: bool, margin: float, engine_margin: float) -> Plan:
    """The config tables' phases on the linear shapes of every shipped model config at each of
    shapes.SHIPPED_TPS it divides, their items shared out over `world` ranks (one GPU's work each: a
    shard's shape at TP=8 is measured on one GPU): what the shipped per-device tables hold."""
    from tp_overlap_plugin.tuning.shapes import shipped_models
    gpu = device == "cuda"
    return Plan("shipped", "shipped", None, world, device, quick, GPU_REPEATS if gpu else 1, margin, engine_margin,
                _config_items(shipped_models(), gpu, quick), shapes="shipped")


def make_plan(model: str, dims: ModelDims, world: int, device: str, quick: bool, margin: float,
              engine_margin: float, model_spec: str | None = None, step_budget: int | None = None,
              fused_ops: str = "auto") -> Plan:
    """`step_budget`: the engine's step token budget the engine check runs prefill steps of (default
    engine_check.DEFAULT_BUDGET). `fused_ops`: the AG-GEMM / GEMM-RS designs measured ("auto": all of
    options.DESIGNS; or one); each design's rows are stored apart (a key suffix)."""
    from tp_overlap_plugin.options import DESIGNS
    from tp_overlap_plugin.tuning import decode_configs, engine_check, gemm_ar, gemv
    dims.check_tp(world)
    if fused_ops != "auto" and fused_ops not in DESIGNS:
        raise ValueError(f"fused_ops must be 'auto' or one of {DESIGNS}, got {fused_ops!r}")
    designs = DESIGNS if fused_ops == "auto" else (fused_ops,)
    gpu = device == "cuda"
    layers = dims.layers(world)
    engine = engine_check.plan_items(model, world, device, step_budget)
    steps = {it["tokens"] for it in engine if it["kind"] == "prefill"}  # the engine's prefill step sizes
    if gpu:
        rows = gemv.decode_rows(quick)
        sizes = [8 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20] if quick else \
            [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20, 8 << 20, 32 << 20]
        tokens = [1, 8, 32] if quick else [1, 8, 32, 128, 256]
        # decode-sized steps (multiples of W: each rank a whole number of rows) up to the prefill sizes, and
        # the engine's own prefill steps: a size between two measured ones runs as the more cautious, so a
        # step of the budget measured only at its neighbours ran qkv and o_proj sequential at 8192 tokens
        # on H200x4 while both won there (bench/notes/prefill.md, section 6)
        fused_ms = sorted({world * m for m in ((2, 64, 512) if quick else (1, 16, 64, 256))} | {1024, 4096, 16384}
                          | steps)
        ar_rows = [1, 16, 64] if quick else list(gemm_ar.ROWS)
        # gate_up with its SiLU-mul fused: in the decode matmul's FMA path (the GEMV's rows that have FMA
        # candidates), and where the layer's matmul is a plain GEMM (the replicated layout past the GEMV's
        # rows, the sequential AG path's gathered rows), up to the prefill sizes
        silu_ms = tuple(m for m in rows if m <= decode_configs.FMA_UPTO) + \
            ((64, 1024, 8192) if quick else (16, 64, 256, 1024, 2048, 4096, 8192))
    else:  # the interpreter: the pipeline, at sizes it runs in seconds (both decode-matmul paths at 4 rows;
        # gate_up fused in the decode matmul at 1 row)
        rows, sizes, tokens, fused_ms, ar_rows, silu_ms = [1], [8 << 10], [1], [2 * world], [1], (1,)
    gate_up = [x for x in layers if x[0] == "gate_up"]
    items = {
        **_config_items({model: (dims, (world,))}, gpu, quick),
        "gemv": [{"key": f"{m}x{k}x{n}", "shape": f"{model} {layer}", "M": m, "K": k, "N": n}
                 for layer, k, n in layers + [dims.lm_head(world)] for m in rows],
        "silu_mul": [{"key": f"{m}x{k}x{n}", "shape": f"{model} {layer}", "M": m, "K": k, "N": n}
                     for layer, k, n in gate_up for m in silu_ms],
    }
    if world > 1:
        items["all_reduce"] = ([{"key": f"ar/{b}", "bytes": b} for b in sizes]
                               + [{"key": f"norm/{dims.hidden}x{t}", "hidden": dims.hidden, "tokens": t} for t in tokens])
        fused = [{"key": f"{LAYER_OPS[layer]}/{m}x{k}x{n}{design_key(d)}", "layer": layer,
                  "op": LAYER_OPS[layer], "M": m, "K": k, "N": n, "design": d}
                 for d in designs for layer, k, n in layers for m in fused_ms]
        # the engine's step sizes of every design first: a run the time budget cuts short keeps the rows the
        # verdict's steps run on (a cut 70B run at TP=4 had measured one design whole and the other's prefill
        # rows not at all, so its verdict ran those steps stock)
        items["fused_ops"] = sorted(fused, key=lambda it: it["M"] not in steps)
        # the interpreter: one row layer shows the pipeline (and eagerly the rule says stock anyway)
        row_layers = [x for x in layers if LAYER_OPS[x[0]] == "rs"][:None if gpu else 1]
        items["gemm_ar"] = [{"key": f"{m}x{k}x{n}", "shape": f"{model} {layer}", "M": m, "K": k, "N": n}
                            for layer, k, n in row_layers for m in ar_rows]
    items["engine"] = engine
    return Plan(model, model_spec or model, dims, world, device, quick, GPU_REPEATS if gpu else 1, margin,
                engine_margin, items, designs)


def design_key(design: str) -> str:
    """A fused-op row's key suffix in the store: none for the one-launch design (rows stored before there
    were two), "@<design>" for the others."""
    return "" if design == "kernel" else f"@{design}"



def plan_candidates(plan: Plan):
    """The configs to try: all of gemm_configs.candidates() on a GPU; on the CPU (interpreter) one of
    each kind, as the pipeline's check."""
    from tp_overlap_plugin.tuning import gemm_configs as gc
    large, small = gc.candidates()
    if plan.device == "cpu":
        return large[:1], [small[0], small[2]]
    return large, small



def heap_bytes(plan: Plan) -> int:
    import torch

    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
    from tp_overlap_plugin.overlap_plan import design_ops
    from tp_overlap_plugin.tuning import all_reduce, gemm_ar
    if plan.world == 1:
        return 1 << 20
    W = plan.world
    size = 0
    ar = plan.items.get("all_reduce")   # (a run of some phases only, `tune --only`, lacks the others)
    if ar:
        top = max(it["bytes"] for it in ar if "bytes" in it)
        tokens = max(it["tokens"] for it in ar if "tokens" in it)
        size = max(HeapAllReduce.heap_bytes(W, top, min(top, 8 << 20)),
                   all_reduce.norm_heap_bytes(W, plan.dims.hidden, tokens))
    fused = 0
    for it in plan.items.get("fused_ops", []):  # one op's buffers at a time (a heap scope per shape)
        rows = -(-it["M"] // W)
        ag, rs = design_ops(it["design"])
        need = (ag.heap_bytes(W, rows, it["K"], torch.bfloat16) if it["op"] == "ag"
                else rs.heap_bytes(W, rows, it["N"], torch.bfloat16)) + (1 << 20)
        fused = max(fused, need)
    size = max(size, fused)
    if plan.items.get("gemm_ar"):
        shapes = [(it["shape"], it["K"], it["N"]) for it in plan.items["gemm_ar"]]
        size = max(size, gemm_ar.heap_bytes(W, shapes, [it["M"] for it in plan.items["gemm_ar"]]))
    return -(-(size + (16 << 20)) // 4096) * 4096


