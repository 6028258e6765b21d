"""The reference job's --backend: gloo lets ranks share a GPU; nccl without CUDA is a usage error."""

from __future__ import annotations

import subprocess
import sys

from trainprof.reference.config import parse_args


def test_backend_flag_parsed():
    assert parse_args([]).backend == "auto"
    assert parse_args(["--backend", "gloo"]).backend == "gloo"


def test_nccl_on_cpu_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "trainprof.reference", "--device", "cpu", "--backend", "nccl",
                        "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--backend nccl needs CUDA" in p.stderr
