"""trainprof's profiler window keeps torch's own lines out of the job's fd 2 (issue 32 item 5):
what else is written to fd 2 meanwhile is written back, and a job that closed fd 2 is left
alone. The wrapped job with fd 2 reused for a data file: tests/integration/test_profiler_fd2.py."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = r"""
import os, sys
from trainprof.probes.profiler_quiet import quiet
os.write(2, b"before\n")
with quiet():
    os.write(2, b"USDT:2026-11-28 22:40:54 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    os.write(2, b"job thread line\n")
    os.write(2, b"[rank1]:[W1128 22:40:54.9 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling started\n")
os.write(2, b"after\n")
"""


def test_profiler_lines_are_dropped_and_the_rest_is_written_back():
    p = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr == b"before\njob thread line\nafter\n"


def test_a_closed_fd_2_is_left_alone():
    code = "import os\nos.close(2)\nfrom trainprof.probes.profiler_quiet import quiet\n" \
           "with quiet():\n    pass\nprint(os.path.exists('/proc/self/fd/2'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr


THREAD = r"""
import os, threading, torch
from trainprof.probes.profiler_quiet import quiet
def window():  # torch was imported on the main thread: kineto objects to a start from here
    p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with quiet():
        p.start()
        os.write(2, b"job thread line\n")
    torch.ones(3).sum()
    with quiet():
        p.stop()
t = threading.Thread(target=window)
t.start(); t.join()
"""


def test_kineto_objecting_to_a_start_on_another_thread_is_dropped():
    """Ray Train's workers run train_func on a thread of their own: a profiler window started
    there makes kineto print an ERROR line (the profiler records all the same)."""
    bare = subprocess.run([sys.executable, "-c", THREAD.replace("with quiet():", "if True:")],
                          capture_output=True, timeout=120)
    assert b"External init callback must run in same thread as registerClient" in bare.stderr
    p = subprocess.run([sys.executable, "-c", THREAD], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == b"job thread line\n"
