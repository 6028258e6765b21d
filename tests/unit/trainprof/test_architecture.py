"""The import graph agrees with the data flow (probes -> run directory -> analyzers -> findings
-> reports), imports inside functions included: every module of the product is parsed and each
import resolved to the folder it lands in."""

from __future__ import annotations

import ast
import collections
import functools
import re

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


@functools.lru_cache(maxsize=None)
def _parsed(path) -> tuple[list[str], ast.Module]:
    src = path.read_text()
    return src.splitlines(), ast.parse(src, str(path))


def imports(mod: str, path) -> list[tuple[str, int]]:
    """(imported module of the product, line) for every import in the file, in functions too."""
    tree = _parsed(path)[1]
    return [(t, n.lineno) for n in ast.walk(tree) for t in _targets(mod, path, n)]


def _targets(mod: str, path, n) -> list[str]:
    """The product module an import statement lands in ([] for any other statement)."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    if True:
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - n.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in n.names] + [base]
        else:
            return out
        for name in names:
            # the longest product module the name lands in (a name imported from a module is
            # that module)
            while name and name not in MODS:
                name = name.rpartition(".")[0]
            # the package root itself (``from trainprof import __version__``) is run by every
            # import of a submodule anyway and imports nothing eagerly
            if name and name != "trainprof" and name != mod:
                out.append(name)
                break
    return out


# Why an import of the product waits inside a function: the trailing comment (or the comment
# line just above) says so in one of these words.
LAZY_REASON = re.compile(r"# lazy: (start-up time of \S.*|optional dependency.*|"
                         r"breaks a cycle (?P<a>[\w.]+)<->(?P<b>[\w.]+))")


def lazy_imports(mod: str, path) -> list[tuple[int, str, str | None]]:
    """(line, imported module, reason comment or None) for every import of the product made
    inside a function."""
    lines, tree = _parsed(path)
    out = []

    def walk(node, in_function):
        for ch in ast.iter_child_nodes(node):
            if in_function and isinstance(ch, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path, ch):
                    # (an import statement holds no string, so its comment starts at its '#')
                    said = [lines[i - 1] for i in range(ch.lineno, ch.end_lineno + 1)]
                    above = lines[ch.lineno - 2].strip() if ch.lineno > 1 else ""
                    if above.startswith("#"):
                        said.append(above)
                    reason = next((m.group(0) for c in said for m in [LAZY_REASON.search(c)] if m), None)
                    out.append((ch.lineno, t, reason))
            walk(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return out


def module_level_edges(mod: str, path) -> set[str]:
    """The product modules a module imports when it is imported (not inside functions, not
    under ``if TYPE_CHECKING:``), its packages' ``__init__`` included."""
    out = {".".join(mod.split(".")[:i]) for i in range(2, len(mod.split(".")))}

    def walk(body):
        for st in body:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path, st):
                    out.add(t)
                    out.update(".".join(t.split(".")[:i]) for i in range(2, len(t.split("."))))
            elif isinstance(st, ast.If) and "TYPE_CHECKING" not in ast.unparse(st.test):
                walk(st.body)
                walk(st.orelse)
            elif isinstance(st, ast.Try):
                walk(st.body)
                walk(st.orelse)
                walk(st.finalbody)
                for h in st.handlers:
                    walk(h.body)

    walk(_parsed(path)[1].body)
    return {t for t in out if t in MODS and t != mod}


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


def test_every_import_inside_a_function_says_why():
    """An import of the product inside a function hides an edge of the graph and costs a lookup
    per call: it stays only with a reason (``# lazy: start-up time of wrap``, ``# lazy: optional
    dependency``, ``# lazy: breaks a cycle a.b<->c.d``), and a cycle it names is real: the
    imported module leads back, through imports made at module level, to the importing one."""
    eager = {m: module_level_edges(m, p) for m, p in MODS.items()}

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                todo.extend(eager.get(x, ()))
        return False

    bad = []
    for m, p in MODS.items():
        for line, t, reason in lazy_imports(m, p):
            where = f"{p.relative_to(REPO)}:{line}: {t}"
            if reason is None:
                bad.append(f"{where}: imported inside a function without '# lazy: <why>'")
                continue
            cyc = LAZY_REASON.search(reason)
            if cyc.group("a") is None:
                continue
            if {cyc.group("a"), cyc.group("b")} != {m.removeprefix("trainprof."), t.removeprefix("trainprof.")}:
                bad.append(f"{where}: the cycle named is not this import's ({reason})")
            elif not reaches(t, m):
                bad.append(f"{where}: no cycle: {t} does not import {m} at module level")
    assert not bad, "function-level imports of the product:\n" + "\n".join(sorted(bad))


def test_the_checker_sees_an_unexplained_lazy_import(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from trainprof.analyzers import hang\n\n\n"
                   "def g():\n    from trainprof import settings  # lazy: start-up time of wrap\n"
                   "    # lazy: optional dependency\n    from trainprof.rundir import (files,\n"
                   "        nodes)\n")
    MODS["trainprof.probes.x"] = src
    try:
        found = lazy_imports("trainprof.probes.x", src)
    finally:
        del MODS["trainprof.probes.x"]
    assert found == [(2, "trainprof.analyzers.hang", None),
                     (6, "trainprof.settings", "# lazy: start-up time of wrap"),
                     (8, "trainprof.rundir.files", "# lazy: optional dependency")]
