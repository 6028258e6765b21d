"""probes/post_import.py: a probe's patch runs right after the job imports a module, never by
importing it ahead (a wrapped job's imports: tests/integration/test_wrap_imports.py)."""

from __future__ import annotations

import sys

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
