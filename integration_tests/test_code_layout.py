"""The code's shape: floors that hold, no import circle in the package, no source file past 600 lines.

Imports are read from the source with `ast`, not executed: cheap, and it sees the imports inside
functions too, which running the modules would only hit on some paths.

The floors, bottom to top: `kernels/` (tp_overlap_plugin.kernels) <- the plugin's core
(tp_overlap_plugin: heap, ops, layers, tables, the vLLM plugin) <- `serving/` (the engine and its server)
<- `tuning/` (`tune` builds engines, and the whole `tp-overlap` command is put together there). A module
imports its own floor and those below, never one above.

How an import counts, for the floors and the circles alike: every import in a module's source, at
module level, inside functions and under `if TYPE_CHECKING:`.
- A function-local import only hides a dependency from the interpreter (it runs once both modules
  have loaded); the design dependency stays: the engine's engine.py <-> engine_core.py circle was two
  function-local imports (AsyncLLM.__init__ and run_core). Import lazily to keep Triton or an optional
  dependency out of a process, never to break a circle or to reach up a floor.
- A TYPE_CHECKING import never runs, but the module names the other's types: a reader of one needs
  the other, and the two are one unit.
- `from package import name` is an edge to the submodule `name` when there is one, else to the package.
  Importing a submodule also runs its parent packages' __init__, but those edges are left out: every
  module would otherwise be in a circle with the package that contains it. The __init__ files here
  import none of their submodules at module level (serving/__init__.py resolves names lazily).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGES = ["tp_overlap_plugin", "tp_overlap_plugin.kernels", "tp_overlap_plugin.ops", "tp_overlap_plugin.serving",
            "tp_overlap_plugin.tuning", "tp_overlap_plugin.cli"]
ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
# Files allowed past the limit, each with the reason it cannot be cut yet: none.
KNOWN_LONG: set[str] = set()


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of PACKAGES and their subpackages (the folders
    pyproject.toml maps them to, wherever they are)."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)   # imports the parents only: `kernels` would load Triton
        top = Path(spec.origin).parent
        for f in top.rglob("*.py"):
            parts = list(f.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods.setdefault(".".join([pkg, *parts]), f)   # (tuning/ is also under tp_overlap_plugin/)
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], type_checking: bool = True,
             third_party: set[str] | None = None) -> set[str]:
    """The package modules `name` imports: at module level, inside functions and, with
    `type_checking`, under TYPE_CHECKING. Other top-level names it imports go into `third_party`
    where one is given (test_engine_core_layout.py walks the core process's imports with both)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    theirs = third_party if third_party is not None else set()

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                visit(other)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
            theirs.update(a.name.split(".")[0] for a in node.names if a.name not in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
                if not mod.startswith("tp_overlap_plugin"):
                    theirs.add(mod.split(".")[0])
            for a in node.names:
                target = f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                if target in mods:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _path_through(graph: dict[str, set[str]], circle: list[str]) -> str:
    """One closed walk through a circle's modules, for the failure message."""
    members, start = set(circle), circle[0]
    walk, seen, v = [start], {start}, start
    while True:
        v = min(w for w in graph[v] if w in members)
        walk.append(v)
        if v in seen:
            return " -> ".join(walk[walk.index(v):])
        seen.add(v)


def test_the_walker_sees_the_packages_and_a_circle():
    """The walker finds every package's modules, and a circle where there is one: a checker that
    found nothing could not fail."""
    mods = _modules()
    for pkg in PACKAGES:
        assert pkg in mods, pkg
    assert {"tp_overlap_plugin.kernels.rma", "tp_overlap_plugin.serving.engine.llm_engine",
            "tp_overlap_plugin.tuning.rules", "tp_overlap_plugin.heap"} <= set(mods)
    assert "tp_overlap_plugin.serving.engine.outputs" in _imports(
        "tp_overlap_plugin.serving.engine.llm_engine", mods["tp_overlap_plugin.serving.engine.llm_engine"], mods)
    # a TYPE_CHECKING import (messages.py names SamplingParams for its annotations) and a function-local
    # one (the `tune` subcommand imports the run when it runs) both count
    assert "tp_overlap_plugin.serving.config" in _imports(
        "tp_overlap_plugin.serving.engine.messages", mods["tp_overlap_plugin.serving.engine.messages"], mods)
    assert "tp_overlap_plugin.tuning.tune" in _imports(
        "tp_overlap_plugin.cli.tune", mods["tp_overlap_plugin.cli.tune"], mods)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _path_through(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


def test_no_import_circle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    circles = _circles(graph)
    assert not circles, "import circles (function-local and TYPE_CHECKING imports count: this file's docstring):\n" + \
        "\n".join(_path_through(graph, c) for c in circles)


# bottom to top; a module's floor is that of the longest of these names its own starts with
FLOORS = ["tp_overlap_plugin.kernels", "tp_overlap_plugin", "tp_overlap_plugin.serving", "tp_overlap_plugin.tuning",
          "tp_overlap_plugin.cli"]


def _floor(module: str) -> int:
    owners = [f for f in FLOORS if module == f or module.startswith(f + ".")]
    assert owners, f"{module} is on no floor"
    return FLOORS.index(max(owners, key=len))


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a floor above the importer's, as "importer (floor) -> imported (floor)"."""
    return [f"{m} ({FLOORS[_floor(m)]}) -> {t} ({FLOORS[_floor(t)]})"
            for m in sorted(graph) for t in sorted(graph[m]) if _floor(t) > _floor(m)]


def test_the_floors_are_told_apart():
    """Each floor's modules map to it, and an upward edge is found: a checker that found nothing could not fail."""
    assert [_floor(m) for m in ("tp_overlap_plugin.kernels.rma", "tp_overlap_plugin.heap", "tp_overlap_plugin.ops.gemm",
                                "tp_overlap_plugin.serving.engine.llm_engine", "tp_overlap_plugin.tuning.tune",
                                "tp_overlap_plugin.tuning", "tp_overlap_plugin.cli.main")] == [0, 1, 1, 2, 3, 3, 4]
    graph = {"tp_overlap_plugin.kernels.rma": {"tp_overlap_plugin.heap"}, "tp_overlap_plugin.heap": set(),
             "tp_overlap_plugin.serving.config": {"tp_overlap_plugin.heap", "tp_overlap_plugin.tuning.tune"},
             "tp_overlap_plugin.tuning.tune": {"tp_overlap_plugin.serving.config", "tp_overlap_plugin.cli.tune"},
             "tp_overlap_plugin.cli.tune": {"tp_overlap_plugin.tuning.tune"}}
    assert _upward(graph) == [
        "tp_overlap_plugin.kernels.rma (tp_overlap_plugin.kernels) -> tp_overlap_plugin.heap (tp_overlap_plugin)",
        "tp_overlap_plugin.serving.config (tp_overlap_plugin.serving) -> tp_overlap_plugin.tuning.tune "
        "(tp_overlap_plugin.tuning)",
        "tp_overlap_plugin.tuning.tune (tp_overlap_plugin.tuning) -> tp_overlap_plugin.cli.tune (tp_overlap_plugin.cli)"]


def test_no_import_reaches_up_a_floor():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    up = _upward(graph)
    assert not up, ("imports of a floor above the importer's (function-local and TYPE_CHECKING imports count; "
                    "move what both need down a floor, or register the upper floor's part from above):\n"
                    + "\n".join(up))


# ---- the command line is read in one place (tp_overlap_plugin/cli/) ----------------------------------

CLI = "tp_overlap_plugin.cli"


def _argparse_imports(tree: ast.AST) -> list[int]:
    """Lines that import argparse (import argparse [as x], from argparse import ...), wherever they stand."""
    return sorted(node.lineno for node in ast.walk(tree)
                  if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names))
                  or (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "argparse"))


def test_only_the_cli_package_imports_argparse():
    """tp_overlap_plugin/cli/ alone turns arguments into typed configs; the server, the benchmarks and tuning take
    those configs. bench/ scripts are standalone tools outside the package and keep their own argparse, and
    tests may build parsers (neither is walked here)."""
    code = "import os\nimport argparse\ndef f():\n    from argparse import Namespace\nimport argparse as ap\n"
    assert _argparse_imports(ast.parse(code)) == [2, 4, 5], "the walker misses an import of argparse"
    mods = _modules()
    assert _argparse_imports(ast.parse(mods[f"{CLI}.main"].read_text())), "the command's main imports argparse"
    outside = {name: lines for name, path in sorted(mods.items())
               if name != CLI and not name.startswith(CLI + ".")
               and (lines := _argparse_imports(ast.parse(path.read_text())))}
    assert not outside, f"argparse outside tp_overlap_plugin/cli/ (take a typed config; the cli makes it): {outside}"


# ---- the environment is read in one place (tp_overlap_plugin/options.py) -----------------------------

ENV_READER = "tp_overlap_plugin.options"
# Modules allowed to read os.environ besides, each with the reason: not a setting read, plumbing.
ENV_PLUMBING = {"tp_overlap_plugin.multirank": "saves the variables it sets around a rank's start, to restore them"}


def _env_reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: os.environ.get / [...] / `in os.environ`, os.getenv. Setting one, or
    copying the whole environment for a child process, reads no setting."""
    # the names `os`, its environ and getenv go by here (import os as o, from os import environ)
    oses, environs, getenvs = {"os"}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            oses |= {a.asname for a in node.names if a.name == "os" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            environs |= {a.asname or a.name for a in node.names if a.name == "environ"}
            getenvs |= {a.asname or a.name for a in node.names if a.name == "getenv"}

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and ast.unparse(node.value) in oses) or \
            (isinstance(node, ast.Name) and node.id in environs)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and is_environ(node.func.value)
                 and node.func.attr in ("get", "setdefault", "items", "keys", "values"))
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv"
                    and ast.unparse(node.func.value) in oses)
                or (isinstance(node.func, ast.Name) and node.func.id in getenvs)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_environment_is_read_in_options_only():
    code = ('import os\nA = os.environ.get("X")\nB = os.environ["Y"]\nC = "Z" in os.environ\nD = os.getenv("W")\n'
            'os.environ["V"] = "1"\nE = dict(os.environ)\nimport os as o\nfrom os import environ as env, getenv\n'
            'F = o.environ.get("U")\nG = env["T"]\nH = getenv("S")\n')
    assert _env_reads(ast.parse(code)) == [2, 3, 4, 5, 10, 11, 12], "the walker misses a read, or counts a write"
    mods = _modules()
    assert _env_reads(ast.parse(mods[ENV_READER].read_text())), "options.py reads the environment"
    readers = {name: _env_reads(ast.parse(path.read_text())) for name, path in mods.items()
               if name != ENV_READER and name not in ENV_PLUMBING}
    readers = {name: lines for name, lines in readers.items() if lines}
    assert not readers, f"read environment variables through tp_overlap_plugin/options.py (one function each): {readers}"


def _source_files() -> list[Path]:
    """Every Python file of the repository, the tests included (issue 53), but what is not ours (venvs, builds)."""
    skip = {"build", "dist"}
    return [f for f in ROOT.rglob("*.py")
            if not any(p in skip or p.startswith(".") or p.endswith(".egg-info") for p in f.relative_to(ROOT).parts)]


def test_no_source_file_past_600_lines():
    files = _source_files()
    assert {"llm_engine.py", "test_code_layout.py"} <= {f.name for f in files} and len(files) > 50
    lengths = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    long = {p: n for p, n in lengths.items() if n > MAX_LINES and p not in KNOWN_LONG}
    assert not long, f"past {MAX_LINES} lines (cut along the concepts a file holds): {long}"
    # an exception whose file has been cut, or is gone, is dropped from KNOWN_LONG
    stale = {p for p in KNOWN_LONG if lengths.get(p, 0) <= MAX_LINES}
    if stale:
        pytest.fail(f"no longer past {MAX_LINES} lines, drop from KNOWN_LONG: {sorted(stale)}")


# ---- the kernels' vocabulary (kernels/__init__.py) ---------------------------------------------------

# Names the world size or the peer count once had: one name per thing now.
RETIRED_PARAMS = {"W", "world", "world_size", "WORLD_SIZE", "NUM_RANKS", "PEERS_POW2", "NUM_PEERS"}


def _kernel_functions():
    for f in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield f.name, node


def test_kernels_name_the_world_size_and_peers_one_way():
    found = list(_kernel_functions())
    assert len(found) > 20, "the walker found too few @triton.jit functions"
    retired = [f"{name}:{fn.name}({a.arg})" for name, fn in found
               for a in fn.args.args + fn.args.kwonlyargs if a.arg in RETIRED_PARAMS]
    assert not retired, f"use WORLD / PEERS (kernels/__init__.py): {retired}"


def test_kernel_helpers_take_flags_by_keyword():
    """A bare True/False among a call's positional arguments inside a kernel: say which flag it sets."""
    bare = []
    for name, fn in _kernel_functions():
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, bool)
                                                  for a in call.args):
                bare.append(f"{name}:{call.lineno} {ast.unparse(call.func)}")
    assert not bare, f"pass these flags by keyword: {bare}"


def test_each_op_has_one_name_across_kernels_and_ops():
    """ops/__init__.py's promise: the host op of a kernel module is the ops/ module of the same name
    (all_reduce, not allreduce; chunked, not a second name for it)."""
    ops = {p.stem for p in (ROOT / "tp_overlap_plugin" / "ops").glob("*.py")} - {"__init__", "device", "operands", "slots"}
    kernels = {p.stem for p in (ROOT / "kernels").glob("*.py")}
    assert ops - kernels == set(), f"ops without a kernel module of their name: {sorted(ops - kernels)}"
    assert {"all_reduce", "all_reduce_norm", "chunked"} <= kernels
