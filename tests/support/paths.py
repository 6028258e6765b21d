"""Where the tests' shared files are: the repository, tests/fixtures (recorded traces, run
directories, summaries) and tests/support/jobs (training scripts the integration tests run)."""
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
JOBS = SUPPORT / "jobs"
