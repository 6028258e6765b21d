"""Every TRAINPROF_* environment variable: its type, accepted values and default.

Probe settings travel to the job's processes as environment variables (each rank reads its
own). `trainprof wrap` and `trainprof demo` check them all here before the job starts: a value
that is not accepted, or a TRAINPROF_* name that is not a setting (a typo), is refused with one
line naming it and what is accepted, and the job is not started. Accepted values are passed on
in one canonical spelling (flags as ``1``/``0``). Every reader — wrap, `trainprof.session()`
(where nothing validated the environment) and every probe — takes a value through value(), one
rule for all.

Standard library only: the probes' runtime imports it inside training processes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

PREFIX = "TRAINPROF_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


# Probe modules (trainprof.probes.NAME) attached to every session, in order. A module that is not
# present in this build is skipped silently; one that fails to attach is reported and skipped.
ATTACHED_PROBE_NAMES: tuple[str, ...] = (
    "clock",           # clock offsets to a reference rank (start and end)
    "hostmap",         # every rank's host, known to each node (meta hosts)
    "collectives",     # always-on log of every collective and p2p op
    "ddp",             # DDP's bucketed gradient all-reduce into that log
    "pipeline_spans",  # forward/backward spans per stage and micro-batch
    "heartbeat",       # crash-safe progress record per rank
    "hang_watchdog",   # dumps stacks and in-flight collectives when stuck
    "fatal_dump",      # Python stacks of a rank killed by a fatal signal
    "nan_watch",       # finiteness of loss / grad norm, origin on detection
    "dataloader",      # time each step waits for its input batches
    "calibration",     # matmul/copy microbenchmark for unknown devices
    "memory",          # allocator stats per step, snapshots, OOM observer
    "telemetry",       # NVML sampler (own GPU only)
)
# Installed before a session starts (bootstrap), yet switched off the same way: the framework
# integrations (probes/frameworks.py) read TRAINPROF_PROBES_OFF themselves.
EARLY_PROBE_NAMES: tuple[str, ...] = ("frameworks",)


def probe_names() -> tuple[str, ...]:
    """What TRAINPROF_PROBES_OFF may name: the probe modules a session attaches."""
    return ATTACHED_PROBE_NAMES + EARLY_PROBE_NAMES


def flag_on(value: str | None, default: bool = False) -> bool:
    """A flag's value: unset or empty -> default; 0/false/no/off -> False; anything else True
    (the probes' reading; `wrap` refuses values that are neither)."""
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in FALSE_WORDS


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str              # flag | seconds | number | count | choice | probe_list | profile_ranks | internal
    default: str
    meaning: str
    choices: tuple = ()
    allow_zero: bool = False  # seconds / number: 0 accepted (else > 0)
    minimum: float = 0.0      # number: the smallest value accepted (when > 0)

    def accepted(self) -> str:
        if self.kind == "flag":
            return "1/0 (also true/false, yes/no, on/off)"
        if self.kind in ("seconds", "number"):
            what = "a number of seconds" if self.kind == "seconds" else "a number"
            if self.minimum > 0:
                return f"{what} >= {self.minimum:g}"
            return f"{what} {'>= 0' if self.allow_zero else '> 0'}"
        if self.kind == "count":
            return "a whole number > 0"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "probe_list":
            return "a comma list of probe names: " + ", ".join(probe_names())
        if self.kind == "profile_ranks":
            return ("all, none, per-node, per-coord, auto, or ranks and ranges such as "
                    "0,3,8-15")
        return "any value (set by trainprof wrap)"

    def parse(self, raw: str) -> str:
        """The canonical value, or ValueError with the reason."""
        v = raw.strip()
        if self.kind == "internal":
            return raw
        if self.kind == "flag":
            low = v.lower()
            if low in TRUE_WORDS:
                return "1"
            if low in FALSE_WORDS:
                return "0"
            raise ValueError
        if self.kind in ("seconds", "number"):
            x = float(v)  # ValueError on "abc"
            if not math.isfinite(x) or x < 0 or (x == 0 and not self.allow_zero) \
                    or x < self.minimum:
                raise ValueError
            return v
        if self.kind == "count":
            n = int(v)
            if n <= 0:
                raise ValueError
            return str(n)
        if self.kind == "choice":
            if v.lower() not in self.choices:
                raise ValueError
            return v.lower()
        if self.kind == "probe_list":
            names = [x.strip() for x in v.split(",") if x.strip()]
            if not names or any(n not in probe_names() for n in names):
                raise ValueError
            return ",".join(names)
        if self.kind == "profile_ranks":
            from trainprof.rankranges import canonical  # lazy: start-up time of the job's bootstrap

            return canonical(v)  # ValueError when not accepted
        raise AssertionError(self.kind)


SETTINGS: tuple[Setting, ...] = (
    Setting("TRAINPROF_DISABLE", "flag", "0", "1: no probe at all (the bare baseline of benchmarks/)"),
    Setting("TRAINPROF_PROBES_OFF", "probe_list", "", "probe modules left out"),
    Setting("TRAINPROF_NAN_MODULES", "choice", "replay", "NaN origin mode (docs/nan.md)",
            choices=("replay", "leaf", "all", "off")),
    Setting("TRAINPROF_NAN_SYNC", "flag", "0", "on CUDA read the finiteness flags every step"),
    Setting("TRAINPROF_NAN_KEEP_MB", "number", "1024",
            "cap on outputs and gradients kept per step for a replay (MiB)", allow_zero=True),
    Setting("TRAINPROF_NAN_PEER_WAIT_S", "seconds", "10",
            "coordinated replay: how long to wait for the peers", allow_zero=True),
    Setting("TRAINPROF_BUDGET_MB", "number", "256",
            "always-on data kept per rank (MiB; wrap --budget-mb): compact per-step tables, the "
            "ring of recent detail, blocks of older steps (probes/compact.py)", minimum=1.0),
    Setting("TRAINPROF_FLUSH_S", "seconds", "1", "how often queued stream records are written"),
    Setting("TRAINPROF_MEMORY_HISTORY", "flag", "0", "record CUDA allocator history, snapshot at exit"),
    Setting("TRAINPROF_MEMORY_HISTORY_ENTRIES", "count", "100000", "allocator history entries kept"),
    Setting("TRAINPROF_TELEMETRY", "flag", "1", "NVML sampler on/off"),
    Setting("TRAINPROF_TELEMETRY_INTERVAL", "seconds", "1.0", "NVML sampling period"),
    Setting("TRAINPROF_CALIBRATION", "flag", "1", "one-off matmul/copy peak calibration"),
    Setting("TRAINPROF_HEARTBEAT_S", "seconds", "1", "heartbeat period"),
    Setting("TRAINPROF_HANG_POLL_S", "seconds", "1", "hang-trigger poll period"),
    Setting("TRAINPROF_CLOCK_TIMEOUT_S", "seconds", "60", "clock alignment budget at start"),
    Setting("TRAINPROF_CLOCK_END_TIMEOUT_S", "seconds", "5", "clock alignment budget at the end",
            allow_zero=True),
    Setting("TRAINPROF_COLLECTIVES_PY", "flag", "0", "1: the pure-Python collective log"),
    Setting("TRAINPROF_TRACE_EXPORT", "choice", "thread",
            "where the profiler window's trace is written: a thread of trainprof's, or inline in "
            "the job's step (docs/overhead.md)", choices=("thread", "inline")),
    Setting("TRAINPROF_MAX_INPUT_MB", "number", "1024",
            "analysis: largest input file read (trainprof/safeio.py, docs/security.md)"),
    Setting("TRAINPROF_DIGEST_WORKERS", "count", "",
            "processes that reduce traces to digests (trainprof/analysis/digest.py; default: the CPUs)"),
    Setting("TRAINPROF_RUN_DIR", "internal", "", "run directory (set by wrap from --out)"),
    Setting("TRAINPROF_PROFILE_STEPS", "internal", "3-4", "profiled steps (set by wrap from --profile-steps)"),
    Setting("TRAINPROF_PROFILE_RANKS", "profile_ranks", "auto",
            "ranks that record a profiler trace (wrap --profile-ranks; probes/profile_ranks.py)"),
    Setting("TRAINPROF_NODE", "internal", "", "this launcher's node record (set by wrap)"),
    Setting("TRAINPROF_RANK_CLAIM", "internal", "",
            "the process that is this rank (set by the probes; probes/rank_claim.py)"),
)
BY_NAME = {s.name: s for s in SETTINGS}


class SettingsError(ValueError):
    """One or more TRAINPROF_* values are not accepted; str() is one line per bad variable."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def check(environ) -> tuple[dict[str, str | None], list[str]]:
    """({name: canonical value, or None to unset}, [one line per refused variable]) for every
    TRAINPROF_* variable in environ."""
    canonical: dict[str, str | None] = {}
    problems: list[str] = []
    for name in sorted(k for k in environ if k.startswith(PREFIX)):
        raw = environ[name]
        s = BY_NAME.get(name)
        if s is None:
            problems.append(f"{name}: not a trainprof setting (a typo?); known: "
                            f"{', '.join(x.name for x in SETTINGS if x.kind != 'internal')}")
            continue
        if s.kind != "internal" and not raw.strip():
            canonical[name] = None  # set but empty: the default, as every probe reads it
            continue
        try:
            value = s.parse(raw)
        except ValueError:
            problems.append(f"{name}={raw!r} is not accepted: expected {s.accepted()} "
                            f"(default {s.default or 'unset'})")
            continue
        # a flag that is off is passed on unset: also what older readers take for off
        canonical[name] = None if name == "TRAINPROF_DISABLE" and value == "0" else value
    return canonical, problems


def validated_env(environ) -> dict[str, str | None]:
    """The canonical TRAINPROF_* values to hand to the job; SettingsError when any is refused."""
    canonical, problems = check(environ)
    if problems:
        raise SettingsError(problems)
    return canonical


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity), the default size of trainprof's pools."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def value(name: str, environ=None):
    """Setting NAME as every reader takes it: unset, empty or not accepted -> its default (`wrap`
    refuses a value that is not accepted before the job starts; under `trainprof.session()`
    nothing did, and a probe never raises into the job). Flags -> bool, seconds and numbers ->
    float, counts -> int (None where the default is unset), the others -> str."""
    s = BY_NAME[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    v = None
    if raw is not None and (s.kind == "internal" or raw.strip()):
        try:
            v = s.parse(raw)
        except ValueError:
            v = None
    if v is None:
        v = s.default
    if s.kind == "flag":
        return v.strip().lower() in TRUE_WORDS
    if s.kind in ("seconds", "number"):
        return float(v) if v else None
    if s.kind == "count":
        return int(v) if v else None
    return v
