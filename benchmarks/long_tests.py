"""The long tests: the further points of the suite's sweeps and its scale checks, which the
default `pytest` leaves out (marked `long`; tests/conftest.py) so that the suite stays within
20 minutes on CI's 2 cores. They are tests like the others (same assertions, same fixtures);
run them before a release or after touching what they cover:

    python benchmarks/long_tests.py [extra pytest arguments, e.g. -k pipeline]

It runs `pytest --long -m long` over tests/ and prints each test's duration.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "--long", "-m", "long", "--durations=0", "-q",
           str(ROOT / "tests"), *argv]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
