"""The tests' layout keeps its split: tests/unit holds single-process tests only. A static check
(no test runs): no module under tests/unit takes the `reference_run` fixture, imports a support
module that starts jobs (tests/support/runs.py, collective_job.py), runs torchrun or `trainprof
wrap`, or spawns processes with torch.multiprocessing; every test under tests/integration is
`multiproc`; test file names are unique."""

from __future__ import annotations

import ast
from paths import TESTS

# tests/support modules whose helpers or fixtures start multi-process jobs
JOB_SUPPORT = {"runs", "collective_job"}
JOB_FIXTURES = {"reference_run", "collective_run"}
LAUNCHERS = {"torch.distributed.run", "torchrun"}  # as the command a test runs, not as data


def job_uses(source: str) -> list[str]:
    """What in this test module starts multi-process jobs (empty: none)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in JOB_SUPPORT]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").split(".")[0] in JOB_SUPPORT:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"fixture {a.arg} in {node.name}" for a in node.args.args if a.arg in JOB_FIXTURES]
        elif isinstance(node, ast.Name) and node.id in JOB_FIXTURES:
            found.append(f"name {node.id}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("spawn", "start_processes") and \
                    isinstance(f.value, ast.Name) and f.value.id in ("mp", "multiprocessing", "torch"):
                found.append(f"{f.value.id}.{f.attr}()")
            # a command list run as [sys.executable, "-m", "torch.distributed.run", ...] or ["torchrun", ...]
            for arg in node.args[:1]:
                if isinstance(arg, ast.List) and len(arg.elts) >= 1:
                    heads = [e.value for e in arg.elts[:3] if isinstance(e, ast.Constant)]
                    if any(h in LAUNCHERS for h in heads) or heads[:1] == ["wrap"]:
                        found.append(f"runs {'/'.join(h for h in heads if h in LAUNCHERS | {'wrap'})}")
    return sorted(set(found))


def test_the_check_sees_each_way_a_test_starts_a_job():
    assert job_uses("def test_a(reference_run, tmp_path): pass") == ["fixture reference_run in test_a"]
    assert job_uses("from runs import straggler_run") == ["from runs import ..."]
    assert job_uses("import collective_job") == ["import collective_job"]
    assert job_uses("import torch.multiprocessing as mp\nmp.spawn(f, nprocs=2)") == ["mp.spawn()"]
    assert job_uses("subprocess.run([sys.executable, '-m', 'torch.distributed.run', 'x'])") == \
        ["runs torch.distributed.run"]
    assert job_uses("run_cli(['wrap', '--out', out, '--', sys.executable, 'job.py'])") == ["runs wrap"]
    assert job_uses("subprocess.run(['torchrun', '--nproc-per-node', '2', 'x.py'])") == ["runs torchrun"]
    # data that merely names a launcher is no job
    assert job_uses("run = {'command': ['torchrun', 'job.py']}") == []
    assert job_uses("from helpers import run_cli\nrun_cli(['analyze', 'r'])") == []


def test_unit_tests_start_no_multi_process_job():
    bad = {}
    for path in sorted((TESTS / "unit").rglob("*.py")):
        uses = job_uses(path.read_text())
        if uses:
            bad[str(path.relative_to(TESTS))] = uses
    assert not bad, f"multi-process job tests belong in tests/integration: {bad}"


def test_test_file_names_are_unique():
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_every_integration_test_is_marked_multiproc():
    import sys

    conftest = sys.modules["conftest"]  # tests/conftest.py, as pytest loaded it

    class Item:
        def __init__(self, path, long=False):
            self.fspath, self.marks, self.long = path, [], long

        def add_marker(self, mark):
            self.marks.append(mark.name)

        def get_closest_marker(self, name):
            return object() if name == "long" and self.long else None

    class Config:
        def __init__(self, long):
            self.long, self.deselected = long, []
            self.hook = type("Hook", (), {"pytest_deselected": lambda _, items: self.deselected.extend(items)})()

        def getoption(self, name):
            return self.long

    def collect(long):
        items = [Item(TESTS / "integration" / "test_wrap.py"), Item(TESTS / "unit" / "trainprof" / "test_rundir.py"),
                 Item(TESTS / "support" / "jobs" / "ddp_job.py"), Item(TESTS / "unit" / "x.py", long=True)]
        config = Config(long)
        conftest.pytest_collection_modifyitems(config, items)
        return items, config

    items, config = collect(long=False)
    assert [i.marks for i in items] == [["multiproc"], [], []]
    assert [i.fspath.name for i in config.deselected] == ["x.py"]  # `long` left out by default
    items, config = collect(long=True)
    assert len(items) == 4 and not config.deselected
