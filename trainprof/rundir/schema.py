"""Field types of the run directory's documented records (docs/run-directory.md), checked in one
place: the reader (trainprof/analysis/run.py).

Every field listed here must have its type when present (null counts as absent); fields not
listed pass through unchecked (additive changes keep the schema version). A stream record with
a wrongly typed field, or without a required one, is skipped; a wrongly typed field of
manifest.json or meta.json is dropped (read as absent). Either way a problem names the file,
the line and the field. Integers must fit in 64 bits: analyzers put them in int64 columns.
"""

from __future__ import annotations

from typing import Callable

_LO, _HI = -(2 ** 63), 2 ** 63


class Field:
    """Allowed Python types (after json.loads), optional bounds [lo, hi) for numbers, and an
    optional extra check for containers."""

    __slots__ = ("types", "lo", "hi", "extra", "expected")

    def __init__(self, types: tuple, expected: str, lo=None, hi=None,
                 extra: Callable[[object], bool] | None = None):
        self.types, self.lo, self.hi, self.extra, self.expected = frozenset(types), lo, hi, extra, expected

    def check(self, v) -> bool:
        if type(v) not in self.types:
            return False
        if self.lo is not None and not (self.lo <= v < self.hi):
            return False
        return self.extra is None or self.extra(v)


def _int(v) -> bool:
    return type(v) is int and _LO <= v < _HI


INT = Field((int,), "an integer", _LO, _HI)
NAT = Field((int,), "an integer >= 0", 0, _HI)
POS = Field((int,), "an integer >= 1", 1, _HI)
NUM = Field((int, float), "a number", extra=lambda v: type(v) is float or _LO <= v < _HI)
FIN = Field((int, float), "a finite number", -1e300, 1e300)
# durations in ms and epoch timestamps in ns: bounded so that sums and ms -> ns stay in int64
MS = Field((int, float), "a duration in ms (finite, below 10^12)", -1e12, 1e12)
NS = Field((int,), "a time in ns (an integer below 2^62)", -(2 ** 62), 2 ** 62)
NSD = Field((int, float), "a time difference in ns (below 2^62)", -(2.0 ** 62), 2.0 ** 62)
STEP = Field((int,), "a step number (an integer >= -1)", -1, 2 ** 40)
STR = Field((str,), "a string")
BOOL = Field((bool,), "true or false")
LIST = Field((list,), "a list")
DICT = Field((dict,), "an object")
INTS = Field((list,), "a list of integers", extra=lambda v: all(_int(x) for x in v))
STRS = Field((list,), "a list of strings", extra=lambda v: all(type(x) is str for x in v))
DICTS = Field((list,), "a list of objects", extra=lambda v: all(type(x) is dict for x in v))
COORDS = Field((dict,), 'an object of integer coordinates, e.g. {"dp": 0, "pp": 1}',
               extra=lambda v: all(type(k) is str and _int(x) for k, x in v.items()))


def _mesh_ok(v, full: bool) -> bool:
    if type(v) is not dict:
        return False
    names, shape = v.get("dim_names"), v.get("shape")
    if names is None and shape is None:
        return True
    if not (STRS.check(names) and INTS.check(shape) and len(names) == len(shape)
            and all(1 <= s < (1 << 24) for s in shape)):
        return False
    coord = v.get("coord")
    return not full or coord is None or (INTS.check(coord) and len(coord) == len(shape))


MESH = Field((dict,), 'an object {"dim_names": [str], "shape": [int >= 1], "coord": [int]} of '
             'equal lengths', extra=lambda v: _mesh_ok(v, True))
MESH_SHAPE = Field((dict,), 'an object {"dim_names": [str], "shape": [int >= 1]} of equal lengths',
                   extra=lambda v: _mesh_ok(v, False))

MANIFEST = {
    "schema_version": INT, "kind": STR, "command": LIST, "cwd": STR, "host": STR,
    "launcher_pid": INT, "python": STR, "trainprof_version": STR, "start_time": DICT,
    "end_time": DICT, "config": DICT, "status": STR, "exit_code": INT, "signal": INT,
    "signal_name": STR, "job_exit_code": INT, "job_signal": INT, "world_size": POS,
    "ranks_seen": NAT, "mesh": MESH_SHAPE, "torch_version": STR, "ranks": DICTS, "env": DICT,
    "hangs": DICTS, "job_id": STR, "node": STR, "files": STRS,
}
# nodes/<host>-<id>.json: one launcher (`trainprof wrap` on one node) of the job
NODE = {
    "node": STR, "job_id": STR, "host": STR, "launcher_pid": INT, "command": LIST, "cwd": STR,
    "start_time": DICT, "end_time": DICT, "status": STR, "exit_code": INT, "signal": INT,
    "signal_name": STR, "job_exit_code": INT, "job_signal": INT, "ranks": INTS,
    "trainprof_version": STR, "hangs": DICTS, "first_failures": DICTS, "files": STRS,
    "signals_forwarded": DICTS,
}
META = {
    "rank": NAT, "world_size": POS, "local_rank": INT, "host": STR, "pid": INT, "argv": LIST,
    "python": STR, "torch_version": STR, "trainprof_version": STR, "backend": STR,
    "device": STR, "device_name": STR, "device_memory_bytes": NAT, "device_count": NAT,
    "cpu_count": POS, "mesh": MESH, "coords": COORDS, "calibration": DICT, "run_info": DICT,
    "activated_by": STR, "profile_steps": INTS, "started_ns": INT, "ended_ns": INT,
    "steps_recorded": NAT, "env": DICT, "probes_off": STRS, "pipeline": DICT, "telemetry": DICT,
    "memory_breakdown": DICT, "profiled": BOOL, "profile_policy": STR, "profile_ranks": STR,
    "node": STR, "hosts": DICT, "process_group_at_exit": DICT, "overhead_spans": DICTS,
}
# meta.json sub-objects the analyzers compute with
RUN_INFO = {
    "tokens_per_step": FIN, "n_params": NAT, "n_params_non_embedding": NAT, "layers": NAT,
    "hidden": NAT, "heads": NAT, "seq_len": NAT, "vocab": NAT, "micro_batches": NAT,
    "global_batch": NAT, "schedule": STR, "dp": NAT, "pp": NAT, "tp": NAT,
    "virtual_stages": NAT, "dtype": STR, "param_dtype": STR, "dp_mode": STR,
    "activation_checkpointing": BOOL, "stage_layers": INTS, "my_stages": INTS,
    "stage_params": DICTS,
}
PIPELINE = {"stages": INTS, "num_stages": NAT, "virtual_stages": NAT, "group_size": NAT,
            "schedule": STR, "micro_batches": NAT}
CALIBRATION = {"device": STR, "device_name": STR, "threads": POS, "cpu_count": POS, "host": STR,
               "copy": DICT, "matmul": DICT}
CALIBRATION_RATES = {"flops_per_s": FIN, "bytes_per_s": FIN, "n": NAT, "bytes": NAT, "dtype": STR}
TIME = {"iso": STR, "ns": NS}
MANIFEST_NESTED = {"start_time": (TIME, None), "end_time": (TIME, None)}
_RATES = (CALIBRATION_RATES, None)
MEMORY_BREAKDOWN = {"params_bytes": NAT, "grads_bytes": NAT, "optimizer_state_bytes": NAT,
                    "n_params_local": NAT, "step": STEP, "param_dtypes": DICT,
                    "optimizer_state_dtypes": DICT}
# meta.json overhead_spans: time trainprof's own work or the job's profiler ran (end null: running)
OVERHEAD_SPAN = {"kind": STR, "start_ns": NS, "end_ns": NS}
META_NESTED = {"overhead_spans": (OVERHEAD_SPAN, None), "memory_breakdown": (MEMORY_BREAKDOWN, None), "run_info": (RUN_INFO, None), "pipeline": (PIPELINE, None),
               "calibration": (CALIBRATION, {"copy": _RATES, "matmul": _RATES, "matmul_*": _RATES})}

# streams: field -> type; REQUIRED fields must be present (and not null)
STREAMS: dict[str, dict[str, Field]] = {
    "steps": {"step": STEP, "start_ns": NS, "end_ns": NS, "dur_ms": MS, "source": STR,
              "profiled": BOOL, "probe_overhead_ms": MS},
    "steps_device": {"step": STEP, "device_ms": MS},
    "collectives": {"step": STEP, "pg": STR, "seq": NAT, "op": STR, "bytes": NAT, "numel": NAT,
                    "dtype": STR, "enqueue_ns": NS, "start_ns": NS, "end_ns": NS,
                    "blocked_ms": MS, "device_ms": MS, "peer": INT, "async": BOOL, "api": STR,
                    "replay": BOOL, "bucket": NAT, "hook": STR, "inferred": BOOL},
    "groups": {"pg": STR, "ranks": INTS, "mesh_dim": STR, "backend": STR, "size": NAT},
    "clock": {"phase": STR, "ref_rank": INT, "offset_ns": NSD, "uncertainty_ns": NSD,
              "t_ns": NS, "rounds": INT},
    "pipeline": {"step": STEP, "stage": NAT, "microbatch": INT, "kind": STR, "start_ns": NS,
                 "end_ns": NS, "device_start_ms": MS, "device_ms": MS},
    "data": {"step": STEP, "wait_ms": MS, "batches": NAT},
    "nan": {"kind": STR, "step": STEP, "module": STR, "module_class": STR, "t_ns": NS,
            "loss": NUM, "grad_norm": NUM, "loss_finite": BOOL, "grad_finite": BOOL,
            "params_finite": BOOL, "modules_finite": BOOL},
    "heartbeat": {"t_ns": NS, "event": STR, "pid": INT, "step": STEP, "last_collective": DICT,
                  "inflight": LIST, "inflight_count": NAT, "fr": DICT},
    "memory": {"step": STEP, "t_ns": NS, "event": STR, "device": STR, "rss_bytes": NAT,
               "peak_rss_bytes": NAT, "allocated_bytes": NAT, "reserved_bytes": NAT,
               "active_bytes": NAT, "requested_bytes": NAT, "inactive_split_bytes": NAT,
               "peak_allocated_bytes": NAT, "peak_reserved_bytes": NAT,
               "peak_active_bytes": NAT, "num_alloc_retries": NAT, "num_ooms": NAT},
    "telemetry": {"t_ns": NS, "step": STEP, "sm_util_pct": NUM, "mem_util_pct": NUM,
                  "mem_used_bytes": NAT, "sm_clock_mhz": NUM, "mem_clock_mhz": NUM,
                  "power_w": NUM, "power_limit_w": NUM, "temp_c": NUM, "throttle": LIST,
                  "ecc_uncorrected": NAT},
}
STREAMS["heartbeat.prev"] = STREAMS["heartbeat"]
# fields holding objects of a documented kind (checked the same way, one level down)
STREAM_NESTED: dict[str, dict[str, dict[str, Field]]] = {
    "heartbeat": {"last_collective": STREAMS["collectives"], "inflight": STREAMS["collectives"]},
}
STREAM_NESTED["heartbeat.prev"] = STREAM_NESTED["heartbeat"]

# ranks/rank-N/hang-dump.json (docs/hangs.md): like meta.json, wrongly typed fields are dropped
FRAME = {"file": STR, "line": INT, "function": STR, "code": STR, "lib": BOOL}
THREAD = {"thread_id": INT, "name": STR, "main": BOOL, "daemon": BOOL, "trainprof": BOOL,
          "frames": LIST}
HANG_DUMP = {"trigger_id": STR, "trigger": DICT, "t_ns": NS, "rank": NAT, "pid": INT,
             "step": STEP, "step_started_ns": NS, "threads": LIST, "last_collective": DICT,
             "inflight": LIST, "heartbeat": DICT, "flight_recorder": DICT, "complete": BOOL,
             "dump_ms": MS}
_COLL = (STREAMS["collectives"], None)
HANG_DUMP_NESTED = {"threads": (THREAD, {"frames": (FRAME, None)}), "last_collective": _COLL,
                    "inflight": _COLL,
                    "heartbeat": (STREAMS["heartbeat"], {"last_collective": _COLL, "inflight": _COLL})}
# digests/rank-N.json (trainprof/analysis/digest.py): a malformed one is rebuilt from the trace
DIGEST = {"schema_version": POS, "kind": STR, "trainprof_version": STR, "code": STR, "rank": NAT,
          "trace": DICT, "facts": DICT, "sections": DICT, "problems": STRS, "seconds": DICT}
DIGEST_REQUIRED = ("schema_version", "kind", "rank", "trace", "facts", "sections")
DIGEST_TRACE = {"path": STR, "size": NAT, "mtime_ns": INT}
DIGEST_FACTS = {"path": STR, "rank": INT, "distributedInfo": DICT, "deviceProperties": LIST,
                "whole_trace_window": BOOL, "span_ns": INTS, "steps": NAT, "events": NAT,
                "gpu_ops_without_launch": NAT}
DIGEST_NESTED = {"trace": DIGEST_TRACE, "facts": DIGEST_FACTS}
REQUIRED: dict[str, tuple[str, ...]] = {
    "steps": ("step",), "steps_device": ("step",), "pipeline": ("step", "stage", "kind"),
    "groups": ("pg",), "collectives": ("op",),
}


def record_error(spec: dict[str, Field], required: tuple, rec: dict,
                 nested: dict | None = None) -> str | None:
    """Why a stream record is unusable (None when it is fine). ``nested``: field -> spec of the
    object (or of each object of the list) it holds."""
    for k in required:
        if rec.get(k) is None:
            return f'lacks "{k}"'
    get = spec.get
    for k, v in rec.items():
        f = get(k)
        if f is None or v is None:
            continue
        if type(v) not in f.types or (f.lo is not None and not (f.lo <= v < f.hi)) \
                or (f.extra is not None and not f.extra(v)):
            return f'"{k}" is {_show(v)}, expected {f.expected}'
        sub = nested.get(k) if nested else None
        if sub is not None:
            for x in (v if type(v) is list else (v,)):
                why = record_error(sub, (), x) if type(x) is dict else "not an object"
                if why:
                    return f'"{k}": {why}'
    return None


def clean_object(spec: dict[str, Field], obj: dict, where: str, problems: list[str],
                 nested: dict | None = None) -> dict:
    """A copy of ``obj`` without the fields of the wrong type (one problem each). ``nested``:
    key (or "prefix*") -> (spec, nested) of sub-objects checked the same way."""
    out = {}
    for k, v in obj.items():
        f = spec.get(k)
        if f is not None and v is not None and not f.check(v):
            problems.append(f'{where}: "{k}" is {_show(v)}, expected {f.expected}; ignored')
            continue
        sub = _sub(nested, k)
        if sub is not None and type(v) is list:  # a list of such objects: each one cleaned
            kept = [clean_object(sub[0], x, f"{where} {k}[{i}]", problems, sub[1])
                    for i, x in enumerate(v) if type(x) is dict]
            if len(kept) < len(v):
                problems.append(f'{where}: "{k}" holds {len(v) - len(kept)} entries that are not '
                                f'objects; ignored')
            v = kept
        elif sub is not None:
            if type(v) is not dict:
                problems.append(f'{where}: "{k}" is {_show(v)}, expected an object; ignored')
                continue
            v = clean_object(sub[0], v, f"{where} {k}", problems, sub[1])
        out[k] = v
    return out


def _sub(nested: dict | None, k: str):
    if not nested:
        return None
    if k in nested:
        return nested[k]
    for pat, sub in nested.items():
        if pat.endswith("*") and k.startswith(pat[:-1]):
            return sub
    return None


def _show(v) -> str:
    """A short, printable description of a value for a problem line."""
    name = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)
    if isinstance(v, (str, int, float, bool)):
        r = repr(v)
        return f"{name} {r[:40] + '…' if len(r) > 40 else r}"
    return name
