"""probes/post_import.py: a probe's patch runs right after the job imports a module, never by
importing it ahead; and a wrapped job that uses neither pipelining nor DDP does not pay for
importing them (torch.distributed.pipelining pulls in DTensor and dynamo: 1-3 s per rank)."""

from __future__ import annotations

import json
import sys

from helpers import run_cli

from trainprof.probes import post_import


def test_patch_runs_after_the_jobs_import_once_and_at_once_when_already_imported(tmp_path, monkeypatch):
    (tmp_path / "tp_post_import_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def patch(module):
        seen.append(module.VALUE)  # the module has executed when the patch runs
        module.VALUE += 1

    post_import.when_imported("tp_post_import_mod", patch)
    post_import.when_imported("tp_post_import_mod", patch)  # the same patch waits once
    assert "tp_post_import_mod" not in sys.modules and seen == []  # nothing imported ahead
    import tp_post_import_mod

    assert seen == [41] and tp_post_import_mod.VALUE == 42
    post_import.when_imported("tp_post_import_mod", lambda m: seen.append("now"))
    assert seen == [41, "now"]
    sys.modules.pop("tp_post_import_mod")


def test_a_failing_patch_only_warns_and_the_import_succeeds(tmp_path, monkeypatch, capsys):
    (tmp_path / "tp_post_import_bad.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    post_import.when_imported("tp_post_import_bad", lambda m: 1 / 0)
    import tp_post_import_bad

    assert tp_post_import_bad.X == 1
    assert "ZeroDivisionError" in capsys.readouterr().err
    sys.modules.pop("tp_post_import_bad")


JOB = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
t = torch.ones(4); dist.all_reduce(t)
dist.destroy_process_group()
print(json.dumps([m for m in ("torch._dynamo", "torch.distributed.pipelining",
                              "torch.distributed.pipelining.stage") if m in sys.modules]))
"""


def test_a_plain_wrapped_job_imports_neither_pipelining_nor_dynamo(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    bare = run_cli(["wrap", "--no-analyze", "--out", tmp_path / "run", "--", sys.executable, script],
                   env={"PORT": str(port)})
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert json.loads(bare.stdout.strip().splitlines()[-1]) == []
    # the probes were active: the all_reduce is in the collective log
    log = (tmp_path / "run" / "ranks" / "rank-00000" / "collectives.jsonl")
    assert log.exists() and '"all_reduce"' in log.read_text()
