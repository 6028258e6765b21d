"""One settings reader: every TRAINPROF_* value is taken through trainprof.settings.value, with
the same rule under `wrap` (validated first) and under `trainprof.session()` (not validated)."""

from __future__ import annotations

import ast
import re

import pytest
from paths import REPO

from trainprof import settings


@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), ("YES", True), ("on", True),
                                       ("0", False), ("false", False), ("No", False), ("off", False)])
def test_flags_read_every_spelling_wrap_accepts(raw, want):
    assert settings.value("TRAINPROF_TELEMETRY", {"TRAINPROF_TELEMETRY": raw}) is want
    assert settings.value("TRAINPROF_MEMORY_HISTORY", {"TRAINPROF_MEMORY_HISTORY": raw}) is want


def test_unset_empty_or_refused_values_are_the_default():
    assert settings.value("TRAINPROF_TELEMETRY", {}) is True
    assert settings.value("TRAINPROF_TELEMETRY", {"TRAINPROF_TELEMETRY": " "}) is True
    assert settings.value("TRAINPROF_TELEMETRY", {"TRAINPROF_TELEMETRY": "maybe"}) is True
    assert settings.value("TRAINPROF_HEARTBEAT_S", {"TRAINPROF_HEARTBEAT_S": "-3"}) == 1.0
    assert settings.value("TRAINPROF_HEARTBEAT_S", {"TRAINPROF_HEARTBEAT_S": "0.25"}) == 0.25
    assert settings.value("TRAINPROF_MEMORY_HISTORY_ENTRIES", {}) == 100000
    assert settings.value("TRAINPROF_DIGEST_WORKERS", {}) is None
    assert settings.value("TRAINPROF_NAN_MODULES", {"TRAINPROF_NAN_MODULES": "LEAF"}) == "leaf"


def test_every_default_is_accepted_by_its_own_parser():
    for s in settings.SETTINGS:
        if s.default and s.kind != "internal":
            s.parse(s.default)


# reading the environment for these stays with their owners: paths and hand-offs set by wrap
# or the probes themselves, not settings a user gives
RAW_READS_ALLOWED = {"TRAINPROF_RUN_DIR", "TRAINPROF_RANK_CLAIM", "TRAINPROF_NODE",
                     "TRAINPROF_PROBES_OFF", "TRAINPROF_PROFILE_RANKS"}


def test_no_probe_reads_a_setting_around_the_reader():
    """No module of probes/ reads a user setting from os.environ itself (four different flag
    rules did: TRAINPROF_TELEMETRY=false left telemetry on under trainprof.session())."""
    bad = []
    for p in sorted((REPO / "probes").glob("*.py")):
        tree = ast.parse(p.read_text())
        consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("get", "getenv") and n.args):
                continue
            owner = ast.unparse(n.func.value)
            if owner not in ("os.environ", "os", "environ"):
                continue
            a = n.args[0]
            name = a.value if isinstance(a, ast.Constant) else consts.get(getattr(a, "id", None))
            if isinstance(name, str) and re.fullmatch(r"TRAINPROF_\w+", name) \
                    and name not in RAW_READS_ALLOWED:
                bad.append(f"{p.name}:{n.lineno} reads {name}")
    assert not bad, "\n".join(bad)
