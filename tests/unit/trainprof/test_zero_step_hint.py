"""After a run of 0 steps the hint never suggests a window wrap rejects (it said
`--profile-steps 1--1`); every window it suggests parses."""

from __future__ import annotations

from trainprof.analysis.runner import window_unreached
from trainprof.analyzers._profiled_window import _window_before
from trainprof.probes.profiler_window import parse_steps
from trainprof.rundir.files import rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir


def _run(root, recorded: int) -> RunDir:
    write_json_atomic(rank_dir(root, 0) / "meta.json", {"rank": 0, "world_size": 1,
                                                       "profile_steps": [3, 4],
                                                       "steps_recorded": recorded})
    return RunDir(root)


def test_zero_steps_says_what_to_do_not_an_impossible_window(tmp_path):
    text = window_unreached(_run(tmp_path / "zero", 0))
    assert "recorded no step" in text and "--profile-steps" not in text
    for n, window in ((1, "0-0"), (2, "1-1"), (3, "1-2")):
        text = window_unreached(_run(tmp_path / str(n), n))
        assert f"--profile-steps {window}`" in text
        parse_steps(window)


def test_window_before_the_last_step_parses():
    assert [_window_before(x) for x in (0, 1, 2, 9)] == ["0-0", "1-1", "1-2", "8-9"]
    for last in range(5):
        first, end = parse_steps(_window_before(last))
        assert end == last
