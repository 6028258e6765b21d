"""The import graph agrees with the data flow (probes -> run directory -> analyzers -> findings
-> reports), imports inside functions included: every module of the product is parsed and each
import resolved to the folder it lands in."""

from __future__ import annotations

import ast
import collections

from paths import REPO

# source folder -> installed package (pyproject's package-dir)
ROOTS = {"trainprof": "trainprof", "probes": "trainprof.probes", "analyzers": "trainprof.analyzers",
         "reports": "trainprof.reports"}
SUBSYSTEMS = ("probes", "analyzers", "reports", "rundir", "launch", "gate", "formats", "analysis",
              "cli", "trace", "reference", "_bootstrap")
CORE = "core"  # trainprof's top-level modules: leaf facts (settings, file formats, devices, ...)
API = "api"  # trainprof/__init__.py (lazy re-exports of the probes' API) and __main__.py

# what each folder may import (besides itself): the layers of the data flow
ALLOWED = {
    CORE: set(),
    "rundir": {CORE},
    "formats": {CORE},
    "trace": {CORE, "rundir"},
    "probes": {CORE, "rundir"},
    "reference": {CORE, "rundir"},
    "_bootstrap": {"probes"},
    "analyzers": {CORE, "rundir", "formats", "trace"},
    "reports": {CORE, "analyzers"},
    "analysis": {CORE, "rundir", "formats", "trace", "analyzers", "reports"},
    "gate": {CORE, "rundir", "analysis", "analyzers"},
    "launch": {CORE, "rundir", "probes"},
    "cli": {CORE, "rundir", "formats", "trace", "analyzers", "reports", "analysis", "gate", "launch",
            "probes", "reference"},
    API: {"probes", "cli"},
}


def modules() -> dict[str, object]:
    out = {}
    for folder, pkg in ROOTS.items():
        for p in (REPO / folder).rglob("*.py"):
            rel = p.relative_to(REPO / folder).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out[".".join([pkg, *parts])] = p
    return out


def folder_of(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return API
    return parts[1] if parts[1] in SUBSYSTEMS else CORE


def imports(mod: str, path) -> list[tuple[str, int]]:
    """(imported module of the product, line) for every import in the file, in functions too."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - n.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in n.names] + [base]
        else:
            continue
        for name in names:
            # the longest product module the name lands in (a name imported from a module is
            # that module)
            while name and name not in MODS:
                name = name.rpartition(".")[0]
            # the package root itself (``from trainprof import __version__``) is run by every
            # import of a submodule anyway and imports nothing eagerly
            if name and name != "trainprof" and name != mod:
                out.append((name, n.lineno))
                break
    return out


MODS = modules()
EDGES = {m: imports(m, p) for m, p in MODS.items()}


def test_every_import_follows_the_layers():
    bad = []
    for m, edges in EDGES.items():
        fa = folder_of(m)
        for t, line in edges:
            fb = folder_of(t)
            if fb != fa and fb not in ALLOWED[fa]:
                bad.append(f"{MODS[m].relative_to(REPO)}:{line}: {fa} imports {fb} ({t})")
    assert not bad, "imports against the data flow:\n" + "\n".join(sorted(bad))


def test_no_cycle_between_folders():
    graph = collections.defaultdict(set)
    for m, edges in EDGES.items():
        for t, _ in edges:
            if folder_of(m) != folder_of(t):
                graph[folder_of(m)].add(folder_of(t))
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle between folders: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_layers_are_a_partial_order():
    """The allowed imports themselves form no cycle (a rule change cannot sneak one in)."""
    seen: dict[str, int] = {}

    def visit(node):
        seen[node] = 1
        for nxt in ALLOWED[node]:
            assert seen.get(nxt) != 1, f"ALLOWED has a cycle through {node} and {nxt}"
            if nxt not in seen:
                visit(nxt)
        seen[node] = 2

    for node in ALLOWED:
        if node not in seen:
            visit(node)


def test_trainprof_top_level_stays_small():
    top = sorted(p.name for p in (REPO / "trainprof").glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at trainprof/'s top level: {top}"
    subsystems = {p.name for p in (REPO / "trainprof").iterdir() if (p / "__init__.py").exists()}
    assert subsystems <= set(SUBSYSTEMS), subsystems - set(SUBSYSTEMS)


def test_the_checker_sees_a_violation(tmp_path):
    """The walk resolves function-level and relative imports (a test that cannot fail is none)."""
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from trainprof.analyzers import hang\n    from ..reports import html\n")
    MODS["trainprof.probes.x"] = src
    try:
        found = {t for t, _ in imports("trainprof.probes.x", src)}
    finally:
        del MODS["trainprof.probes.x"]
    assert "trainprof.analyzers.hang" in found and any(t.startswith("trainprof.reports") for t in found)
