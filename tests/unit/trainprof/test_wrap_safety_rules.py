"""wrap's safety rules in one process: every setting validated, the disable flag's values, which
rank died first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO


ROOT = REPO


def test_every_setting_the_code_reads_is_validated():
    """A TRAINPROF_* name read anywhere in the code or listed in the README must be a setting
    (else `wrap` would refuse it as a typo), and every setting must be documented."""
    from trainprof.settings import BY_NAME, probe_names
    from trainprof.probes.session import ATTACHED_PROBES, EARLY_PROBES

    pattern = re.compile(r"TRAINPROF_[A-Z][A-Z_]*[A-Z]")
    used = set()
    for folder in ("probes", "trainprof", "analyzers", "reports"):
        for p in (ROOT / folder).rglob("*.py"):
            used |= set(pattern.findall(p.read_text()))
    readme = (ROOT / "README.md").read_text()
    documented = set(pattern.findall(readme))
    assert used - set(BY_NAME) == set()
    assert documented - set(BY_NAME) == set()
    public = {n for n, s in BY_NAME.items() if s.kind != "internal"}
    assert public - documented == set()
    assert set(probe_names()) == {n.rsplit(".", 1)[-1] for n in ATTACHED_PROBES} | set(EARLY_PROBES)


@pytest.mark.parametrize("value, on", [("0", True), ("false", True), ("no", True), ("off", True),
                                        ("", True), ("1", False), ("yes", False), ("TRUE", False)])
def test_disable_flag_values(monkeypatch, tmp_path, value, on):
    from trainprof.probes import runtime

    monkeypatch.setenv(runtime.ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(runtime.ENV_DISABLE, value)
    assert runtime.enabled() is on
    # the bootstrap decides the same before importing anything of trainprof's
    res = subprocess.run([sys.executable, "-c", "import sys; print('trainprof.probes.bootstrap' in sys.modules)"],
                         env={**os.environ, "PYTHONPATH": str(ROOT / "trainprof" / "_bootstrap")},
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == str(on), res.stderr


def test_bootstrap_refuses_another_copy_of_trainprof_and_says_so(tmp_path):
    # a worker Python that imports another trainprof (another install, another checkout: a
    # `torchrun` of another environment) would run probes the launcher and the analysis do not
    # expect; one that cannot import trainprof at all gets none. Either is said on stderr, and
    # the job runs as it is.
    other = tmp_path / "other"
    (other / "trainprof" / "probes").mkdir(parents=True)
    (other / "trainprof" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (other / "trainprof" / "probes" / "__init__.py").write_text("")
    (other / "trainprof" / "probes" / "bootstrap.py").write_text(
        "def install():\n    print('OTHER PROBES')\n")
    boot = str(ROOT / "trainprof" / "_bootstrap")
    env = {**os.environ, "TRAINPROF_RUN_DIR": str(tmp_path / "run"), "TRAINPROF_DISABLE": "0"}
    res = subprocess.run([sys.executable, "-c", "print('job')"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": os.pathsep.join([boot, str(other)])}, timeout=60)
    assert res.returncode == 0 and res.stdout == "job\n", res
    assert f"imports trainprof 0.0.1 from {other / 'trainprof'}" in res.stderr
    from trainprof import __version__

    assert f"`trainprof wrap` is {__version__} from {os.path.realpath(ROOT / 'trainprof')}" \
        in res.stderr
    # another copy of the same version is the same trainprof (pipx for the CLI, the job's
    # environment for the probes): its probes run
    (other / "trainprof" / "__init__.py").write_text(f'__version__ = "{__version__}"\n')
    res = subprocess.run([sys.executable, "-c", "print('job')"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": os.pathsep.join([boot, str(other)])}, timeout=60)
    assert res.stdout == "OTHER PROBES\njob\n" and "trainprof" not in res.stderr, res
    # this checkout's own trainprof: no word of it
    res = subprocess.run([sys.executable, "-c", "print('job')"], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": boot, "TRAINPROF_DISABLE": "1"}, timeout=60)
    assert res.stdout == "job\n" and "trainprof" not in res.stderr, res.stderr
    # a Python that cannot import trainprof: -S drops site-packages (and sitecustomize with it),
    # so run the bootstrap by hand the way site would
    code = f"import runpy; runpy.run_path({os.path.join(boot, 'sitecustomize.py')!r}); print('job')"
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, cwd=tmp_path)
    assert res.stdout == "job\n" and "cannot import trainprof" in res.stderr, res


def _synthetic(root: Path, ranks: dict, status="failed", exits=None, end_ns=None) -> Path:
    from synth import _write_run

    _write_run(root, ranks, status=status, end_ns=end_ns or int(200e9))
    if exits is not None:
        (root / "worker-exits.jsonl").write_text(json.dumps(exits) + "\n")
    return root


def _hb(t_s, step, seq=None):
    lc = {"pg": "0", "seq": seq, "op": "all_reduce", "step": step - 1, "enqueue_ns": int(t_s * 1e9)} \
        if seq is not None else None
    return {"t_ns": int(t_s * 1e9), "event": "progress", "step": step, "last_collective": lc,
            "inflight": [], "inflight_count": 0, "fr": None}


def test_died_first_from_agent_record_signal_before_error_exit(tmp_path):
    from trainprof.analyzers import hang
    from trainprof.analysis.run import RunDir

    ranks = {r: [_hb(100 + i, i, seq=2 * i) for i in range(1, 6)] for r in range(3)}
    exits = {"t_ns": int(106e9), "event": "workers_closed", "host": "h", "agent_pid": 1,
             "restart": 0, "workers": [
                 {"rank": 0, "local_rank": 0, "pid": 10, "exitcode_at_close": 1, "exitcode": 1},
                 {"rank": 1, "local_rank": 1, "pid": 11, "exitcode_at_close": -9, "exitcode": -9},
                 {"rank": 2, "local_rank": 2, "pid": 12, "exitcode_at_close": None, "exitcode": -15}]}
    res = hang.analyze(RunDir(_synthetic(tmp_path / "r", ranks, exits=exits)))
    (f,) = res.findings
    c = f.evidence["culprit"]
    assert f.ranks == [1] and c["reason"] == "died" and c["signal_name"] == "SIGKILL"
    assert c["also_failed"] == [0] and c["step"] == 5 and c["last_collective"]["seq"] == 10
    assert f.severity == "error" and not res.metrics["hung"]  # the job ended at the agent's close
    assert "rank 1 was the first to fail: killed by SIGKILL (signal 9) in step 5" in f.message
    assert "the launcher then ended rank 2" in f.message
    states = {row["rank"]: row["state"] for row in res.metrics["ranks"]}
    assert states == {0: "died", 1: "died", 2: "ended_by_launcher"}


def test_died_first_from_heartbeats_alone_and_together_is_silent(tmp_path):
    from trainprof.analyzers import hang
    from trainprof.analysis.run import RunDir

    # rank 1's heartbeat stopped at 103 s while rank 0 went on to 110 s; the job then failed
    ranks = {0: [_hb(100 + i, i, seq=i) for i in range(11)],
             1: [_hb(100 + i, i, seq=i) for i in range(4)]}
    res = hang.analyze(RunDir(_synthetic(tmp_path / "a", ranks, end_ns=int(110.5e9))))
    (f,) = res.findings
    assert f.ranks == [1] and f.evidence["culprit"]["reason"] == "died"
    assert "heartbeat" in f.evidence["culprit"]["source"]
    # both stopped together (a job killed as a whole while healthy): nothing to single out
    ranks = {r: [_hb(100 + i, i, seq=i) for i in range(5)] for r in range(2)}
    res = hang.analyze(RunDir(_synthetic(tmp_path / "b", ranks, end_ns=int(104.5e9))))
    assert res.findings == [] and res.metrics["hung"] is False
    # every worker exited 0 per the agent: silent
    ok = {"t_ns": int(105e9), "event": "workers_closed", "host": "h", "restart": 0, "workers": [
        {"rank": r, "local_rank": r, "pid": r, "exitcode_at_close": 0, "exitcode": 0} for r in range(2)]}
    res = hang.analyze(RunDir(_synthetic(tmp_path / "c", ranks, status="ok", exits=ok,
                                         end_ns=int(104.5e9))))
    assert res.findings == []
