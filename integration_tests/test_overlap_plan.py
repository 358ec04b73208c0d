"""The `tp_overlap` flag as one plan (tp_overlap_plugin/overlap_plan.py): the dispatch table is read in
the plan's constructor alone, a rank makes one plan, the plan resolves the design once, the `true`
shorthand goes one way, and the engine core runs on the config the front end handed it."""

import ast
from pathlib import Path

import pytest

from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.options import TPOverlapOptions
from tp_overlap_plugin.overlap_plan import OverlapPlan

ROOT = Path(__file__).resolve().parents[1]
# where the package's modules are (pyproject.toml maps kernels/ and serving/ into it)
PACKAGE_DIRS = ("tp_overlap_plugin", "serving", "kernels")

# call -> the one function allowed to make it: the plan reads the table through Dispatcher.load, which
# alone asks the tables package for a dispatch table (explicit path, then the cache, then the shipped one)
ONLY_CALLER = {"Dispatcher.load": "tp_overlap_plugin/overlap_plan.py:OverlapPlan.__init__",
               'tables.load("dispatch")': "tp_overlap_plugin/dispatch.py:Dispatcher.load"}


def _table_reads(tree: ast.AST) -> list[tuple[str, str]]:
    """(call, enclosing Class.function) of every Dispatcher.load and tables.load("dispatch", ...) call,
    under any name the module imports them by."""
    dispatchers, loaders, tables_mods = {"Dispatcher"}, set(), {"tables"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if a.name == "Dispatcher":
                    dispatchers.add(a.asname or a.name)
                elif a.name == "load" and node.module.endswith("tables"):
                    loaders.add(a.asname or a.name)
                elif a.name == "tables":
                    tables_mods.add(a.asname or a.name)
    found = []

    def visit(node: ast.AST, where: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = [*where, node.name]
        if isinstance(node, ast.Call):
            f = node.func
            first = node.args[0] if node.args else None
            dispatch_kind = isinstance(first, ast.Constant) and first.value == "dispatch"
            if isinstance(f, ast.Attribute) and f.attr == "load" and ast.unparse(f.value).split(".")[-1] in dispatchers:
                found.append(("Dispatcher.load", ".".join(where)))
            elif dispatch_kind and ((isinstance(f, ast.Attribute) and f.attr == "load"
                                     and ast.unparse(f.value).split(".")[-1] in tables_mods)
                                    or (isinstance(f, ast.Name) and f.id in loaders)):
                found.append(('tables.load("dispatch")', ".".join(where)))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, [])
    return found


def test_the_table_is_read_in_the_plans_constructor_only():
    code = ("from tp_overlap_plugin.dispatch import Dispatcher as D\nfrom tp_overlap_plugin import tables as t\n"
            "from tp_overlap_plugin.tables import load as ld\n"
            "class A:\n    def f(self):\n        return D.load('table')\n"
            "def g():\n    t.load('dispatch', 'cpu')\n    ld('dispatch')\n    t.load('gemm', 'cpu')\n")
    assert _table_reads(ast.parse(code)) == [("Dispatcher.load", "A.f"), ('tables.load("dispatch")', "g"),
                                             ('tables.load("dispatch")', "g")], "the walker misses a table read"
    files = [f for d in PACKAGE_DIRS for f in (ROOT / d).rglob("*.py")]
    assert len(files) > 50 and ROOT / "tp_overlap_plugin" / "overlap_plan.py" in files
    reads = {(call, f"{f.relative_to(ROOT).as_posix()}:{where}")
             for f in files for call, where in _table_reads(ast.parse(f.read_text(), str(f)))}
    assert reads == set(ONLY_CALLER.items()), (
        "the dispatch table is read where the rank's plan is made, and nowhere else: take the plan "
        f"(tp_overlap_plugin/overlap_plan.py), not a table of your own. Found: {sorted(reads)}")


def test_the_plan_resolves_the_design_once():
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
    from tp_overlap_plugin.ops.chunked import ChunkedAllGatherGemm, ChunkedGemmReduceScatter
    from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter

    rows = [{"op": "ag", "M": 64, "K": 8, "N": 8, "sequential_ms": 2.0, "ours_ms": 1.0, "winner": "overlap"}]
    chunked = Dispatcher(gemm=rows, fused_ops="chunked")
    auto = OverlapPlan(TPOverlapOptions(), "cpu", 2, dispatcher=chunked)   # auto: the table's design
    assert auto.design == "chunked" and auto.dispatcher is chunked
    assert (auto.ag_gemm, auto.gemm_rs) == (ChunkedAllGatherGemm, ChunkedGemmReduceScatter)
    # a design the table did not measure runs without the table's fused-op rows, and says so
    kernel = OverlapPlan(TPOverlapOptions(fused_ops="kernel"), "cpu", 2, dispatcher=chunked)
    assert kernel.design == "kernel" and kernel.dispatcher.gemm == [] and (kernel.ag_gemm, kernel.gemm_rs) == (
        AllGatherGemm, GemmReduceScatter)
    assert "--fused-ops kernel" in kernel.startup_warnings()[-1]
    assert not kernel.graph_step(4096, [("ag", 8, 8)])   # only the chunked ops take large steps in graphs
    sized = OverlapPlan(TPOverlapOptions(max_bytes=1 << 20, heap_size=3 << 20), "cpu", 2, dispatcher=Dispatcher())
    assert sized.max_bytes == 1 << 20 and sized.heap_bytes(1) == 3 << 20
    with pytest.raises(ValueError, match="the plan is for TP=2"):
        from tp_overlap_plugin.layers import TPGroup
        from tp_overlap_plugin.overlap_layers import OverlapTPLayers
        OverlapTPLayers(TPGroup(0, 1, None), None, "cpu", None, 16, sized)


def test_the_shorthand_goes_one_way(monkeypatch):
    from tp_overlap_plugin.serving import EngineConfig

    monkeypatch.delenv("TP_OVERLAP", raising=False)
    assert EngineConfig(tp_overlap=True).tp_overlap == TPOverlapOptions.from_section(True, "x") == TPOverlapOptions()
    assert EngineConfig(tp_overlap=False).tp_overlap is None is TPOverlapOptions.from_section(False, "x")
    monkeypatch.setenv("TP_OVERLAP", "1")
    assert EngineConfig().tp_overlap == TPOverlapOptions()


# ---- one plan per rank, in an engine run on the CPU ------------------------------------------------

SMALL = dict(block_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=32,
             show_progress=False, dist_timeout_s=60)


def _count_plans(made: list, set_attr=setattr) -> None:
    """Count, in this process, the plans made and the tables read (each appends to `made`)."""
    init, load = OverlapPlan.__init__, Dispatcher.load.__func__

    def counted_init(self, *args, **kwargs):
        made.append("plan")
        init(self, *args, **kwargs)

    def counted_load(cls, *args, **kwargs):
        made.append("table")
        return load(cls, *args, **kwargs)
    set_attr(OverlapPlan, "__init__", counted_init)
    set_attr(Dispatcher, "load", classmethod(counted_load))


def _generate(llm) -> None:
    out = llm.generate(["a plan", "per rank"], {"max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2])
def test_rank_zero_makes_one_plan(tp, monkeypatch):
    """The engine in this process (rank 0; at TP=2 it spawns rank 1): one plan, one table read, from
    the start-up check before the spawn to the last step."""
    from tp_overlap_plugin.serving import LLM, EngineConfig

    monkeypatch.delenv("TP_OVERLAP", raising=False)
    made: list = []
    _count_plans(made, monkeypatch.setattr)
    with LLM(EngineConfig(tensor_parallel_size=tp, tp_overlap=True, **SMALL)) as llm:
        _generate(llm)
        assert llm.engine.core.runner.plan is llm.engine.core.runner.layers.plan
    assert made == ["plan", "table"]


def _launched_rank(ctx):
    # every rank builds the engine on an initialised process group, as under torchrun
    from tp_overlap_plugin.serving import LLM, EngineConfig

    made: list = []
    _count_plans(made)
    llm = LLM(EngineConfig(tensor_parallel_size=ctx.world_size, tp_overlap=True, **SMALL))
    if llm.is_driver:
        _generate(llm)
        llm.shutdown()
    return made


@pytest.mark.timeout(120)
def test_every_rank_makes_one_plan(monkeypatch):
    from tp_overlap_plugin.multirank import run_ranks

    monkeypatch.delenv("TP_OVERLAP", raising=False)
    assert run_ranks(_launched_rank, 2, timeout=90) == [["plan", "table"]] * 2


@pytest.mark.timeout(60)
def test_the_core_runs_on_the_config_the_front_end_handed_it():
    from tp_overlap_plugin.serving import AsyncLLM, EngineConfig

    cfg = EngineConfig(tp_overlap={"dispatch": "stock"}, **SMALL)
    seen = []
    eng = AsyncLLM(cfg, in_thread=True, core_setup=lambda core: seen.append(core.cfg))
    try:
        assert seen[0] is cfg and seen[0].tp_overlap is cfg.tp_overlap   # no dump and parse on the way
    finally:
        eng.shutdown()
