"""Pipeline bubble measured on a real pipelined run of the reference job against the schedule's
theory."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli


# Balanced p=2 pipeline. Theory takes every hand-over between the stages as free and every
# micro-batch as equally long; two things on a CPU host break that and are kept small here:
# * a hand-over (gloo p2p over loopback, waking the blocked rank, the schedule's Python) costs
#   ~3-8 ms, on the critical path of both schedules. Few tokens per micro-batch (4 sequences of
#   32) through wide, deep stages (hidden 1024, 4 layers each): ~100 ms forward and ~250 ms
#   backward per micro-batch against a 512 KiB activation, so hand-overs stay ~2 % of the window.
# * glibc hands freed memory back to the kernel every step and the next step faults it in again
#   (50-75k minor faults per rank and step measured in this VM), stretching some micro-batches
#   up to 2x. The MALLOC_* settings keep the heap, as CUDA's caching allocator does on a GPU.
# Steps 1-4 are analysed (step 0 is warm-up); the job value is their median.
BUBBLE_ARGS = ["--dp", "1", "--pp", "2", "--tp", "1", "--hidden", "1024", "--layers", "8",
               "--seq-len", "32", "--steps", "5"]


BUBBLE_ENV = {"MALLOC_TRIM_THRESHOLD_": str(16 << 30), "MALLOC_TOP_PAD_": str(256 << 20),
              "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


@pytest.mark.multiproc
# one point in the default suite; the sweep's others run with --long (benchmarks/long_tests.py)
@pytest.mark.parametrize("schedule,m", [
    ("1f1b", 4),
    *[pytest.param(s, m, marks=pytest.mark.long) for s in ("gpipe", "1f1b") for m in (2, 4, 8)
      if (s, m) != ("1f1b", 4)]])
def test_measured_bubble_matches_theory(reference_run, tmp_path, schedule, m):
    run = reference_run(f"bubble-{schedule}-m{m}", nproc=2,
                        args=BUBBLE_ARGS + ["--schedule", schedule, "--micro-batches", str(m),
                                             "--global-batch", str(4 * m)],
                        wrap_args=["--profile-steps", "none"], env=BUBBLE_ENV)
    proc = run_cli(["analyze", run, "--out", tmp_path, "--no-report"])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    pm = summary["metrics"]["pipeline"]
    theory = (2 - 1) / (m + 2 - 1)
    assert pm["theory"]["share"] == pytest.approx(theory)
    d = pm["decomposition"]
    print(f"{schedule} m={m}: measured {pm['bubble_fraction']:.3f} theory {theory:.3f} "
          f"replayed with free hand-overs {d['replayed_free_handovers']:.3f}")
    assert abs(pm["bubble_fraction"] - theory) <= 0.05, pm["bubble_fraction_by_step"]
    # the replay keeps every measured duration and order and only drops the hand-overs: never
    # a longer window than the real one (host timeline), and every analysed step replayed
    assert d["replayed_free_handovers"] <= pm["bubble_fraction"] + 1e-9
    assert set(d["replayed_by_step"]) == set(pm["bubble_fraction_by_step"])
    assert all(d["replayed_by_step"][s] <= v + 1e-9 for s, v in pm["bubble_fraction_by_step"].items())
    assert not [f for f in summary["findings"] if f["kind"] in ("stage_imbalance", "straggler")]
    if schedule == "1f1b" and m == 4:
        from trainprof.reports.sections import pipeline as section

        html = section.render(pm, summary)
        assert "<svg" in html and "Gantt" in html
        assert len(pm["gantt"]["spans"]) == 2 * 2 * m  # F and B of every micro-batch, 2 stages
