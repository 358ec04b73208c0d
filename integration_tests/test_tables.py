"""One table system (tp_overlap_plugin/tables/): the package alone opens table files, it writes every kind
through one checked, locked, atomic writer with one serialiser, and every shipped table names the one
command that measures it again, a command that exists.

"Opens a table path" is read from the source with `ast`, per function: a call that opens, reads or
writes a file (open, Path.read_text / write_text / read_bytes / write_bytes / open, files.write_atomic,
files.locked) on an expression made of a table's path (tables.cached_path / shipped_path / table_name,
a shipped tables' folder by name, the cache folder of a kind) or of a name assigned from one."""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
import subprocess
import sys

import pytest

from test_code_layout import ROOT, _modules
from tp_overlap_plugin import tables

PATH_MAKERS = {"cached_path", "shipped_path", "table_name"}
OPENERS = {"read_text", "write_text", "read_bytes", "write_bytes", "open", "write_atomic", "locked"}
FOLDERS = {k.folder for k in tables.KINDS.values()}
# what the code calls a table's path where it comes in as an argument: `table_path`, the option `dispatch_table`
PATH_NAMES = re.compile(r"(.*_)?table_path$|dispatch_table$")


def _table_paths(func: ast.AST) -> set[str]:
    """The names assigned, in this scope, from an expression that makes a table's path (to a fixpoint:
    a name made of such a name is one too)."""
    names: set[str] = set()
    while True:
        before = len(names)
        for node in ast.walk(func):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.For, ast.withitem)):
                value = getattr(node, "value", None) or getattr(node, "iter", None) or getattr(node, "context_expr", None)
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [getattr(node, "target", None) or getattr(node, "optional_vars", None)])
                if value is not None and _is_table_path(value, names):
                    names.update(n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name))
        if len(names) == before:
            return names


def _is_table_path(expr: ast.AST, names: set[str]) -> bool:
    nodes = list(ast.walk(expr))
    for n in nodes:
        if isinstance(n, ast.Call):
            f = n.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in PATH_MAKERS:
                return True
        if isinstance(n, ast.Name) and (n.id in names or PATH_NAMES.match(n.id)):
            return True
        if isinstance(n, ast.Attribute) and PATH_NAMES.match(n.attr):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and any(d in n.value for d in FOLDERS):
            return True
    # the cache's folder of a kind: cache_dir() / "dispatch" / ...
    calls_cache = any(isinstance(n, ast.Call) and "cache_dir" in ast.unparse(n.func) for n in nodes)
    return calls_cache and any(isinstance(n, ast.Constant) and n.value in tables.KINDS for n in nodes)


def table_opens(source: str, filename: str = "<source>") -> list[str]:
    """Every call in `source` that opens a table's path, as "line: code"."""
    tree = ast.parse(source, filename)
    found = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        names = _table_paths(scope)
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            opener = (isinstance(f, ast.Name) and f.id == "open") or (isinstance(f, ast.Attribute) and f.attr in OPENERS)
            operands = [*node.args, *(k.value for k in node.keywords)]
            if isinstance(f, ast.Attribute):
                operands.append(f.value)
            if opener and any(_is_table_path(o, names) for o in operands):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_checker_finds_a_table_opened_raw():
    """Each way the tables were opened before the package (tune.py, engine_check.py, report.py) is
    found, an argument named as a table's path too; asking where a table is, or whether it exists, is
    not opening it."""
    raw = '''
def a(device_name, world):
    table = json.loads(tables.cached_path("dispatch", device_name, world).read_text())

def b(kind, device_name, w):
    path = tables.cached_path(kind, device_name, w)
    data = json.loads(path.read_text()) if path.exists() else {}

def c(device_name):
    gpath = tables.cached_path("gemm", device_name)
    with tables.locked(gpath):
        tables.write_atomic(gpath, "{}")

def d():
    return open(ROOT / "tp_overlap_plugin" / "gemm_tables" / "h200.json").read()

def e(name):
    return (tables.cache_dir() / "dispatch" / name).read_text()

def g(table_path):
    return json.loads(open(table_path).read())
'''
    assert len(table_opens(raw)) == 7, table_opens(raw)
    fine = '''
def f(device_name, world):
    if not tables.cached_path("dispatch", device_name, world).exists():
        return tables.read("dispatch", device_name, world)
    log(f"looked for {tables.shipped_path('gemm', device_name)}")
    return (tables.cache_dir() / "evidence" / "x.md").write_text("")
'''
    assert table_opens(fine) == []


def test_no_module_but_the_tables_package_opens_a_table():
    """The package, the kernels, serving, tuning and the bench scripts reach tables through the
    tables package only."""
    sources = {name: path for name, path in _modules().items() if not name.startswith("tp_overlap_plugin.tables")}
    sources.update({f"bench/{p.name}": p for p in (ROOT / "bench").glob("*.py")})
    assert "tp_overlap_plugin.tuning.tune" in sources and "tp_overlap_plugin.tables" not in sources
    opened = {name: hits for name, path in sources.items() if (hits := table_opens(path.read_text(), str(path)))}
    assert opened == {}, f"tables opened outside tp_overlap_plugin/tables/ (use tables.read / write / load): {opened}"


# ---- write, read, the one serialiser ------------------------------------------------------------

def _dispatch(device="cpu", world=2, **extra) -> dict:
    return {"device": device, "world": world, "date": "2026-11-28", **tables.versions("cpu"), "command": "x",
            "margin": 1.02, "gemm": [], "all_reduce": [{"bytes": 8192, "graph_winner": "ipc", "eager_winner": "stock"}],
            **extra}


def test_write_then_load_gives_the_same_table(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_OVERLAP_CACHE", str(tmp_path))
    table = _dispatch(engine=[{"M": 16, "shapes": [["ag", 64, 96]], "runs": "replicated"}])
    path = tables.write("dispatch", "cpu", 2, table)
    assert path == tables.cached_path("dispatch", "cpu", 2) and tables.read("dispatch", "cpu", 2) == table
    fields, found = tables.load("dispatch", "cpu", "stock", world=2, current=tables.versions("cpu"))
    assert found.origin == "cache" and found.warnings == []
    assert fields["all_reduce"] == table["all_reduce"] and fields["engine_rows"] == table["engine"]
    # a copy at a path of its own (tune's engine check) goes through the same writer
    copy = tables.write("dispatch", "cpu", 2, table, path=tmp_path / "copy.json")
    assert copy.read_text() == path.read_text() and tables.read("dispatch", path=copy) == table
    assert tables.read("dispatch", "cpu", 4) is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no temporary left


@pytest.mark.parametrize("change, error", [
    (lambda t: t.pop("command"), "needs the fields \\['command'\\]"),
    (lambda t: t.pop("torch"), "needs the fields \\['torch'\\]"),
    (lambda t: t.update(world=4), "TP=4"),
    (lambda t: t.update(device="NVIDIA H200"), "'NVIDIA H200'"),
    (lambda t: t.update(gemv="oops"), "'gemv' must be a list of rows"),
])
def test_write_refuses_a_table_its_readers_would_not_take(tmp_path, monkeypatch, change, error):
    monkeypatch.setenv("TP_OVERLAP_CACHE", str(tmp_path))
    table = _dispatch()
    change(table)
    with pytest.raises(ValueError, match=error):
        tables.write("dispatch", "cpu", 2, table)
    assert not tables.cached_path("dispatch", "cpu", 2).exists()


def test_one_serialiser_keeps_every_shipped_table():
    """Every shipped table, of every kind, parses as its kind and comes back whole from the one
    serialiser; a list of rows is one row a line (a diff of two tables reads as the changed rows)."""
    for kind in tables.KINDS.values():
        for path in sorted((tables.PACKAGE_DIR / kind.folder).glob("*.json")):
            data = json.loads(path.read_text())
            kind.parse(data, dict)
            text = kind.dump(data)
            assert json.loads(text) == data, path
            rows = next(v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict))
            assert sum(line.startswith("  {") for line in text.splitlines()) >= len(rows)


def test_the_dispatch_schema_is_written_once():
    """The Dispatcher's fields are the sections' (tables.DISPATCH.sections), and tune's rules make a
    table with each section its phase measured."""
    import dataclasses

    from tp_overlap_plugin.dispatch import Dispatcher
    from tp_overlap_plugin.tuning import rules
    fields = {f.name for f in dataclasses.fields(Dispatcher)}
    assert {s.field for s in tables.DISPATCH.sections} <= fields
    env = {"device": "cpu", "tp": 2, "date": "2026-11-28", **tables.versions("cpu")}
    built = rules.build({"gemv": {}, "engine": {}}, env, command="x")
    assert {s.key for s in tables.DISPATCH.sections if s.always or s.phase in ("gemv", "engine")} <= set(built)
    assert "gemm_all_reduce" not in built and built["engine_margin"] == rules.ENGINE_MARGIN
    tables.DISPATCH.check(built, "cpu", 2)


# ---- every shipped table names the command that measures it again ------------------------------

SHIPPED = sorted(p.relative_to(tables.PACKAGE_DIR).as_posix() for k in tables.KINDS.values()
                 for p in (tables.PACKAGE_DIR / k.folder).glob("*.json"))
# every one is tune's now: the H200 config tables come from SHIPPED_CONFIGS_COMMAND (one H200, 2026-11-28)


def _console_script(name: str) -> list[str]:
    """How to run pyproject's console script `name` from this checkout (its [project.scripts] line)."""
    (target,) = re.findall(rf'^{re.escape(name)}\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    module, func = target.split(":")
    return [sys.executable, "-c", f"import sys, {module} as m; sys.exit(m.{func}())"]


@functools.lru_cache(maxsize=None)
def _help(subcommand: str) -> subprocess.CompletedProcess:
    """`tp-overlap <subcommand> --help`, once per test session (a process start costs seconds here)."""
    return subprocess.run(_console_script("tp-overlap") + [subcommand, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def _command_exists(command: str) -> list[str]:
    """What is wrong with a table's command (each `&&` part): a program that is not ours, a script or
    module that is not there, an option its parser does not take."""
    import importlib.util
    wrong = []
    for part in command.split("&&"):
        argv = shlex.split(part)
        if argv[:1] == ["tp-overlap"]:
            helped = _help(argv[1])
            options = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
            wrong += [f"{part.strip()}: `{o}` is not an option of `tp-overlap {argv[1]}`" for o in options
                      if o not in helped.stdout] or ([] if helped.returncode == 0 else [helped.stderr[-500:]])
        elif argv[:2] == ["python", "-m"]:
            wrong += [] if importlib.util.find_spec(argv[2]) else [f"no module {argv[2]}"]
        elif argv[:1] == ["python"]:
            wrong += [] if (ROOT / argv[1]).is_file() else [f"no script {argv[1]}"]
        else:
            wrong.append(f"{part.strip()}: not a command of this repository")
    return wrong


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_table_names_a_command_that_exists(name):
    data = json.loads((tables.PACKAGE_DIR / name).read_text())
    assert data.get("command"), f"{name} names no command that measures it again"
    assert _command_exists(data["command"]) == []


SHIPPED_CONFIGS_COMMAND = tables.tune_command(1, shapes="shipped")


def test_the_command_that_regenerates_the_shipped_config_tables_exists():
    assert SHIPPED_CONFIGS_COMMAND == "tp-overlap tune --tp 1 --shapes shipped"
    assert _command_exists(SHIPPED_CONFIGS_COMMAND) == []


def test_the_command_check_fails_on_a_retired_script():
    assert _command_exists("python bench/make_dispatch_table.py --gemv x") == ["no script bench/make_dispatch_table.py"]
    assert _command_exists("python -m tp_overlap_plugin.nothing_here") == ["no module tp_overlap_plugin.nothing_here"]
    assert _command_exists("tp-overlap tune --tp 2 --no-such-option 1")[0].endswith("is not an option of `tp-overlap tune`")
