"""serving/'s floors (serving/README.md, Layering): a module imports only from its own folder and the
floors below it. Imports are read as test_code_layout.py reads them (module level and inside functions,
not under TYPE_CHECKING), so a call-time import cannot hide an upward edge."""

from test_code_layout import _imports, _modules

PKG = "tp_overlap_plugin.serving"
# Each part of serving/ (a folder, or a top-level module) and its floor: higher imports lower, never
# the other way; two parts of one floor import neither each other.
# (The command, which imports them all, is the package's top floor: tp_overlap_plugin/cli/.)
FLOORS = {"entrypoints": 4, "benchmarks": 4, "engine": 3, "worker": 2, "model": 1, "config": 0, "metrics": 0,
          "user_errors": 0}
# issue 45: serving/ keeps a handful of files at its top level (__init__.py included); the rest live in
# the floors' folders
MAX_TOP_LEVEL = 8
# Upward imports that stay, each with its reason: config.py checks and builds, inside functions, with
# the floor that owns the rule (the piecewise graphs' token counts; the demo model's config).
KNOWN_UPWARD = {(f"{PKG}.config", f"{PKG}.worker.piecewise"), (f"{PKG}.config", f"{PKG}.model.demo")}


def _part(module: str):
    parts = module.split(".")
    return parts[2] if module.startswith(PKG + ".") else None


def _serving_edges() -> list[tuple[str, str]]:
    mods = _modules()
    return [(name, target) for name, path in sorted(mods.items()) if _part(name)
            for target in sorted(_imports(name, path, mods)) if _part(target)]


def test_every_part_of_serving_has_a_floor():
    parts = {_part(m) for m in _modules() if _part(m)}
    assert parts == set(FLOORS), f"give each new folder or top-level module of serving/ a floor: {parts ^ set(FLOORS)}"
    top = sorted(f.name for f in _modules()[PKG].parent.glob("*.py"))
    assert "config.py" in top and len(top) <= MAX_TOP_LEVEL, f"serving/ holds {len(top)} files at its top level: {top}"


def test_serving_imports_only_downward():
    edges = _serving_edges()
    assert (f"{PKG}.engine.core", f"{PKG}.worker.runner") in edges   # the walker sees the edges
    upward = [f"{a} -> {b}" for a, b in edges
              if _part(a) != _part(b) and FLOORS[_part(b)] >= FLOORS[_part(a)] and (a, b) not in KNOWN_UPWARD]
    assert not upward, "imports that point up serving/'s floors (serving/README.md, Layering):\n" + "\n".join(upward)
    stale = KNOWN_UPWARD - set(edges)
    assert not stale, f"no longer imported, drop from KNOWN_UPWARD: {sorted(stale)}"
