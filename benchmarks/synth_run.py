"""Synthesize an N-rank run directory from a real small one, for scale benchmarks and tests.

    python benchmarks/synth_run.py OUT --ranks N [--traces K] [--straggler R --delay-ms D]
                                   [--source RUN] [--jitter 0.03] [--seed 0] [--force]

The source is a real run directory (default: the 4-rank ``--dp 4`` reference run in
tests/fixtures/scale/dp4-run.tar.gz, or ``--source RUN``: a run directory or such a .tar.gz).
Its outermost mesh dimension (dp) is scaled so that the mesh holds N ranks; target rank r copies
the source rank at the same mesh coordinates with dp taken modulo the source's dp degree, and
every rank id is rewritten everywhere: ranks/rank-NNNNN folders, meta.json (rank, world size,
host, local rank, pid, env, mesh coordinates), the streams' rank fields (p2p peers, the NaN
watch's replay groups), groups.jsonl member lists, the profiler traces' distributedInfo, the
manifest (world size, mesh shape, per-rank entries, files) and worker-exits.jsonl. Eight ranks
per host (node000, node001, ...); hosts other than node000 get a clock offset of up to
``--clock-skew-ms`` with the matching clock.jsonl estimate, so the analysis has to align clocks.

Timing model (a synchronous job): at the start of every step each rank does extra work
e(r, k) = jitter × (1 + u) × step, u uniform in [-1, 1] (± jitter around the mean, never
negative); the straggler adds ``--delay-ms`` on-CPU work (as the reference's ``straggler``
fault does: a compute loop at the top of the step). The first collective after a step boundary
then completes when the last rank arrives: every rank's later timestamps move by the largest
extra of the step, its enqueue by its own extra, and its ``blocked_ms`` (and ``device_ms``)
grows by the difference: peers wait for the straggler in the collective log, the straggler's
own time grows, step durations grow for everyone. Every absolute ``*_ns`` timestamp of every
stream and the traces' events go through the same per-rank time map.

Only ``--traces K`` ranks keep a profiler trace (evenly spaced, rank 0 first; default 8); the
steps keep the source's profiler-window marks (their durations include its cost).
``injected.json`` records the injected straggler and the synthesis parameters (analyzers never
read it).

Reusable from tests: ``synthesize(out, ranks, ...)`` returns the run directory.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import orjson

    def _dumps(obj) -> str:
        return orjson.dumps(obj).decode()

    def _dumps_indent(obj) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n"

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency of trainprof
    def _dumps(obj) -> str:
        return json.dumps(obj, separators=(",", ":"))

    def _dumps_indent(obj) -> bytes:
        return (json.dumps(obj, indent=2) + "\n").encode()

    _loads = json.loads

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "scale" / "dp4-run.tar.gz"
RANKS_PER_HOST = 8
EPOCH_NS = 10 ** 17  # an int *_ns field above this is an absolute timestamp (not a duration)
_SLOT = re.compile(r'"@@([A-Z])@@"')


# --------------------------------------------------------------------------- source


class Source:
    """The parsed source run: per rank its meta, streams and trace; the mesh; time anchors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = json.loads((self.path / "manifest.json").read_text())
        self.ranks: dict[int, dict] = {}
        for d in sorted((self.path / "ranks").glob("rank-*")):
            r = int(d.name[5:])
            rank = {"meta": json.loads((d / "meta.json").read_text()), "streams": {}, "files": {}}
            for f in sorted(d.iterdir()):
                if f.name == "meta.json":
                    continue
                if f.suffix == ".jsonl":
                    rank["streams"][f.stem] = [_loads(x) for x in f.read_bytes().splitlines()
                                               if x.strip()]
                elif f.is_file():
                    rank["files"][f.name] = f.read_bytes()  # copied verbatim
            self.ranks[r] = rank
        if not self.ranks:
            raise SystemExit(f"{self.path}: no ranks/rank-*/ in the source run")
        self.S = max(self.ranks) + 1
        if sorted(self.ranks) != list(range(self.S)):
            raise SystemExit(f"{self.path}: the source run lacks ranks "
                             f"{sorted(set(range(self.S)) - set(self.ranks))}")
        mesh = self.ranks[0]["meta"].get("mesh") or {}
        self.dim_names = list(mesh.get("dim_names") or ["dp"])
        self.shape = [int(x) for x in (mesh.get("shape") or [self.S])]
        if math.prod(self.shape) != self.S:
            raise SystemExit(f"{self.path}: mesh {self.shape} does not hold its {self.S} ranks")
        self.inner = math.prod(self.shape[1:])  # ranks per outermost (dp) coordinate
        self.traces = {int(p.name[5:10]): p for p in sorted((self.path / "profiler").glob("rank-*.json*"))}
        self.worker_exits = _read_jsonl(self.path / "worker-exits.jsonl")
        self.nodes = [json.loads(p.read_text()) for p in sorted((self.path / "nodes").glob("*.json"))]
        self._anchors()

    def _anchors(self) -> None:
        """Per rank: step boundaries B[0..K] and the first collective enqueue after each."""
        self.K = min(len(r["streams"].get("steps", [])) for r in self.ranks.values())
        if self.K < 2:
            raise SystemExit(f"{self.path}: the source ranks need at least 2 steps")
        self.step_ms = np.zeros(self.K)
        for s, rank in self.ranks.items():
            st = sorted(rank["streams"]["steps"], key=lambda x: x["step"])[:self.K]
            B = np.array([x["start_ns"] for x in st] + [st[-1]["end_ns"]], dtype=np.int64)
            coll = rank["streams"].get("collectives", [])
            enq = np.array(sorted(c["enqueue_ns"] for c in coll if isinstance(c.get("enqueue_ns"), int)),
                           dtype=np.int64)
            E1 = B[:-1].copy()
            first = {}
            for k in range(self.K):
                i = np.searchsorted(enq, B[k], side="right")
                if i < len(enq) and enq[i] < B[k + 1]:
                    E1[k] = enq[i]
                    first[int(enq[i])] = k
            rank["B"], rank["E1"], rank["first"] = B, E1, first
            self.step_ms += np.diff(B) / 1e6
        self.step_ms /= len(self.ranks)

    def coords(self, s: int) -> tuple:
        return tuple(int(x) for x in np.unravel_index(s, self.shape))


def _read_jsonl(p: Path) -> list[dict]:
    try:
        return [_loads(x) for x in p.read_bytes().splitlines() if x.strip()]
    except OSError:
        return []


def load_source(source: str | os.PathLike | None = None) -> Path:
    """The source run directory: ``source`` (a run directory or a .tar.gz of one), else the
    repository's fixture, unpacked once under the system's temporary folder."""
    src = Path(source) if source else FIXTURE
    if src.is_dir():
        return src
    if not src.is_file():
        raise SystemExit(f"{src}: no such source run (give --source RUN_DIR)")
    st = src.stat()
    cache = Path(tempfile.gettempdir()) / f"trainprof-synth-src-{src.name}-{st.st_size}-{int(st.st_mtime)}"
    if not (cache / "manifest.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        with tarfile.open(src) as tf:
            tf.extractall(tmp, filter="data")
        roots = [p.parent for p in tmp.rglob("manifest.json")]
        if not roots:
            raise SystemExit(f"{src}: no manifest.json inside")
        try:
            os.replace(roots[0], cache)
        except OSError:  # another process unpacked it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


# --------------------------------------------------------------------------- layout


class Layout:
    """Target mesh and rank mapping: the source's outermost dim scaled to hold N ranks."""

    def __init__(self, src: Source, n: int, per_host: int):
        if n % src.inner:
            raise SystemExit(f"--ranks {n}: must be a multiple of {src.inner} (the source mesh "
                             f"{src.shape} without its outermost dim)")
        self.src, self.n, self.per_host = src, n, per_host
        self.d0_src = src.shape[0]
        self.shape = [n // src.inner] + src.shape[1:]
        self._group_cache: dict = {}

    def coords(self, r: int) -> tuple:
        return tuple(int(x) for x in np.unravel_index(r, self.shape))

    def ravel(self, c) -> int:
        return int(np.ravel_multi_index(tuple(c), self.shape))

    def source_of(self, r: int) -> int:
        c = self.coords(r)
        return int(np.ravel_multi_index((c[0] % self.d0_src,) + c[1:], self.src.shape))

    def host(self, r: int) -> str:
        return f"node{r // self.per_host:03d}"

    def peer(self, p: int, r: int) -> int:
        """Source rank p as seen from target rank r: the same dp block as r."""
        if not isinstance(p, int) or not 0 <= p < self.src.S:
            return p
        b = self.coords(r)[0] // self.d0_src
        c = self.src.coords(p)
        return self.ravel((b * self.d0_src + c[0],) + c[1:])

    def members(self, src_members, r: int) -> list[int]:
        """A source group's member list as seen from target rank r: a group covering the whole
        source dp range covers the whole target dp range; any other group stays in r's block."""
        ms = tuple(int(m) for m in src_members if isinstance(m, int) and 0 <= m < self.src.S)
        if len(ms) != len(src_members):
            return list(src_members)
        cs = [self.src.coords(m) for m in ms]
        full = {c[0] for c in cs} == set(range(self.d0_src)) and self.d0_src > 0
        key = (ms, None if full else self.coords(r)[0] // self.d0_src)
        if key not in self._group_cache:
            if full:
                rest = sorted({c[1:] for c in cs})
                out = sorted(self.ravel((v,) + c) for v in range(self.shape[0]) for c in rest)
            else:
                b = key[1]
                out = sorted(self.ravel((b * self.d0_src + c[0],) + c[1:]) for c in cs)
            self._group_cache[key] = out
        return self._group_cache[key]

    def coords_dict(self, r: int, src_coords: dict) -> dict:
        c = self.coords(r)
        out = dict(src_coords or {})
        name0 = self.src.dim_names[0]
        for key in (name0, "dp"):
            if key in out or key == name0:
                out[key] = c[0]
                break
        return out


# --------------------------------------------------------------------------- timing


class Timing:
    """Per-rank time maps (see the module docstring): extra work e[r, k], the job's extra per
    step X[k] = max_r e[r, k], cumulative G[k]; per-host clock offsets."""

    def __init__(self, lay: Layout, jitter: float, straggler: int | None, delay_ms: float,
                 skew_ms: float, seed: int):
        src = lay.src
        rng = np.random.default_rng(seed)
        u = rng.uniform(-1.0, 1.0, size=(lay.n, src.K))
        self.e = (jitter * (1.0 + u) * src.step_ms[None, :] * 1e6).astype(np.int64)
        if straggler is not None:
            self.e[straggler, :] += int(round(delay_ms * 1e6))
        self.X = self.e.max(axis=0)
        self.G = np.cumsum(self.X)
        hosts = (lay.n + lay.per_host - 1) // lay.per_host
        off = rng.uniform(-skew_ms, skew_ms, size=hosts) * 1e6
        off[0] = 0.0  # rank 0's host: the reference clock
        self.host_off = off.astype(np.int64)
        self.lay = lay
        self.Gl, self.el = self.G.tolist(), self.e.tolist()
        for rank in src.ranks.values():
            rank["Bl"], rank["E1l"] = rank["B"].tolist(), rank["E1"].tolist()

    def shift(self, r: int, s: int, t):
        """Shift (ns) of source rank s's times ``t`` (int or int64 array) for target rank r,
        without the host's clock offset."""
        rank = self.lay.src.ranks[s]
        B, E1 = rank["B"], rank["E1"]
        K = len(B) - 1
        t = np.asarray(t, dtype=np.int64)
        k = np.searchsorted(B, t, side="left") - 1  # last boundary strictly before t
        kc = np.clip(k, 0, K - 1)
        Gprev = np.where(kc > 0, self.G[np.maximum(kc - 1, 0)], 0)
        inside = t <= E1[kc]
        out = np.where(inside, Gprev + self.e[r, kc], self.G[kc])
        out = np.where(k < 0, 0, np.where(k >= K, self.G[K - 1], out))
        return out

    def shift_one(self, r: int, s: int, t: int) -> int:
        """shift() of one timestamp, without numpy's per-call cost."""
        rank = self.lay.src.ranks[s]
        B, E1 = rank["Bl"], rank["E1l"]
        K = len(B) - 1
        k = bisect.bisect_left(B, t) - 1
        if k < 0:
            return 0
        if k >= K:
            return self.Gl[K - 1]
        if t <= E1[k]:
            return (self.Gl[k - 1] if k > 0 else 0) + self.el[r][k]
        return self.Gl[k]

    def clock(self, r: int) -> int:
        return int(self.host_off[r // self.lay.per_host])


# --------------------------------------------------------------------------- writing


class Writer:
    def __init__(self, src: Source, lay: Layout, tim: Timing, out: Path, traced: list[int],
                 straggler: int | None, delay_ms: float):
        self.src, self.lay, self.tim, self.out = src, lay, tim, out
        self.traced, self.straggler, self.delay_ms = traced, straggler, delay_ms
        self.files: list[str] = []
        self._coll_tpl: dict[int, tuple] = {}
        self._trace_src: dict[int, tuple] = {}

    # -- generic records
    def _map_times(self, r: int, s: int, obj):
        """Every absolute *_ns int of a small record (nested) through r's time map."""
        off = self.tim.clock(r)
        lay = self.lay

        def walk(o, key=None):
            if isinstance(o, dict):
                return {k: walk(v, k) for k, v in o.items()}
            if isinstance(o, list):
                if key in ("replay_with", "ranks"):
                    return lay.members(o, r)
                return [walk(v) for v in o]
            if type(o) is int and key is not None:
                if key.endswith("_ns") and o > EPOCH_NS:
                    return o + self.tim.shift_one(r, s, o) + off
                if key == "peer":
                    return lay.peer(o, r)
                if key == "pid":
                    return self._pid(r)
            return o

        return walk(obj)

    def _pid(self, r: int) -> int:
        return 100000 + r % self.lay.per_host * 10 + 7

    # -- collectives: one template per source record, two slots (enqueue, end)
    def _templates(self, s: int):
        if s not in self._coll_tpl:
            recs = self.src.ranks[s]["streams"].get("collectives", [])
            pre, mid, post, enq, end, special = [], [], [], [], [], []
            first = self.src.ranks[s]["first"]
            for i, rec in enumerate(recs):
                e, n = rec.get("enqueue_ns"), rec.get("end_ns")
                ok = type(e) is int and (n is None or type(n) is int)
                if not ok or rec.get("peer") is not None or e in first:
                    special.append(i)  # re-serialized per target (p2p peer, first of a step)
                    pre.append(""), mid.append(""), post.append("")
                    enq.append(0), end.append(-1)
                    continue
                t = dict(rec, enqueue_ns="@@E@@", end_ns="@@N@@" if n is not None else None)
                parts = _SLOT.split(_dumps(t))
                if n is None:
                    pre.append(parts[0]), mid.append(parts[2]), post.append("")
                else:
                    pre.append(parts[0]), mid.append(parts[2]), post.append(parts[4])
                enq.append(e), end.append(n if n is not None else -1)
            self._coll_tpl[s] = (recs, pre, mid, post, np.array(enq, np.int64),
                                 np.array(end, np.int64), special)
        return self._coll_tpl[s]

    def _collectives(self, r: int, s: int) -> str:
        recs, pre, mid, post, enq, end, special = self._templates(s)
        if not recs:
            return ""
        off = self.tim.clock(r)
        ne = (enq + self.tim.shift(r, s, enq) + off).tolist()
        has_end = end >= 0
        nd = np.where(has_end, end + self.tim.shift(r, s, np.where(has_end, end, 0)) + off, -1).tolist()
        lines = [p + str(a) + m + (str(b) + q if b >= 0 else "")
                 for p, a, m, b, q in zip(pre, ne, mid, nd, post)]
        first = self.src.ranks[s]["first"]
        for i in special:
            rec = recs[i]
            new = self._map_times(r, s, rec)
            k = first.get(rec.get("enqueue_ns"))
            if k is not None:  # waits for the step's last arrival
                extra_ms = (int(self.tim.X[k]) - int(self.tim.e[r, k])) / 1e6
                for f in ("blocked_ms", "device_ms"):
                    if isinstance(rec.get(f), (int, float)) and not isinstance(rec.get(f), bool):
                        new[f] = round(rec[f] + extra_ms, 6)
            lines[i] = _dumps(new)
        return "\n".join(lines) + "\n"

    def _steps(self, r: int, s: int) -> str:
        out = []
        for rec in self.src.ranks[s]["streams"].get("steps", []):
            new = self._map_times(r, s, rec)
            if isinstance(new.get("start_ns"), int) and isinstance(new.get("end_ns"), int):
                new["dur_ms"] = round((new["end_ns"] - new["start_ns"]) / 1e6, 6)
            k = rec.get("step")
            if isinstance(k, int) and 0 <= k < self.src.K and isinstance(rec.get("cpu_ms"), (int, float)):
                new["cpu_ms"] = round(rec["cpu_ms"] + int(self.tim.e[r, k]) / 1e6, 6)  # own work is on-CPU
            out.append(_dumps(new))
        return "\n".join(out) + "\n" if out else ""

    def _clock_stream(self, r: int, s: int) -> str:
        off = self.tim.clock(r)
        out = []
        for rec in self.src.ranks[s]["streams"].get("clock", []):
            new = self._map_times(r, s, rec)
            if isinstance(rec.get("offset_ns"), (int, float)) and r // self.lay.per_host:
                new["offset_ns"] = rec["offset_ns"] - off  # local clock ahead by off
            out.append(_dumps(new))
        return "\n".join(out) + "\n" if out else ""

    def _meta(self, r: int, s: int) -> dict:
        src_meta = self.src.ranks[s]["meta"]
        m = self._map_times(r, s, src_meta)
        lay, n = self.lay, self.lay.n
        host_i, local = divmod(r, lay.per_host)
        m.update(rank=r, world_size=n, local_rank=local, host=lay.host(r), pid=self._pid(r))
        if isinstance(m.get("env"), dict):
            env = dict(m["env"])
            for k, v in (("RANK", r), ("LOCAL_RANK", local), ("WORLD_SIZE", n),
                         ("LOCAL_WORLD_SIZE", lay.per_host), ("GROUP_RANK", host_i),
                         ("ROLE_RANK", r), ("MASTER_ADDR", lay.host(0))):
                if k in env:
                    env[k] = str(v)
            m["env"] = env
        if isinstance(m.get("mesh"), dict):
            m["mesh"] = dict(m["mesh"], shape=list(lay.shape), coord=list(lay.coords(r)))
        if isinstance(src_meta.get("coords"), dict):
            m["coords"] = lay.coords_dict(r, src_meta["coords"])
        # each rank does the source rank's work: the global batch grows with dp, and an FSDP
        # shard shrinks with it
        grow = lay.shape[0] / lay.d0_src
        ri = m.get("run_info")
        if isinstance(ri, dict) and isinstance(ri.get("dp"), int):
            ri = dict(ri, dp=lay.shape[0])
            for k in ("tokens_per_step", "global_batch"):
                if isinstance(ri.get(k), int):
                    ri[k] = int(round(ri[k] * grow))
            m["run_info"] = ri
            mb = m.get("memory_breakdown")
            if isinstance(mb, dict) and (ri.get("dp_mode") or "fsdp") == "fsdp":
                m["memory_breakdown"] = {k: int(round(v / grow)) if k in (
                    "params_bytes", "grads_bytes", "optimizer_state_bytes", "n_params_local")
                    and isinstance(v, int) else v for k, v in mb.items()}
        for d in m.get("ddp") or []:
            if isinstance(d, dict) and isinstance(d.get("world"), int):
                d["world"] = n
        if isinstance(m.get("calibration"), dict) and "host" in m["calibration"]:
            m["calibration"] = dict(m["calibration"], host=lay.host(r))
        if r not in self.traced:
            m.pop("job_profiler", None)
        return m

    # -- traces
    def _trace(self, r: int, s: int) -> bytes:
        if s not in self._trace_src:
            with gzip.open(self.src.traces[s], "rb") as f:
                doc = _loads(f.read())
            base = doc.get("baseTimeNanoseconds")
            base = int(base) if isinstance(base, (int, float)) else 0
            evs = [e for e in doc.get("traceEvents", []) if isinstance(e.get("ts"), (int, float))]
            timed = [e for e in evs if isinstance(e.get("dur"), (int, float))]
            instant = [e for e in evs if not isinstance(e.get("dur"), (int, float))]
            ts = np.array([float(e["ts"]) for e in timed])
            te = ts + np.array([float(e["dur"]) for e in timed])
            ti = np.array([float(e["ts"]) for e in instant])
            self._trace_src[s] = (doc, base, timed, instant, ts, te, ti)
        doc, base, timed, instant, ts, te, ti = self._trace_src[s]

        def moved(us):  # µs relative to base, through r's time map
            return us + self.tim.shift(r, s, (base + us * 1000.0).astype(np.int64)) / 1000.0

        a, b = moved(ts), moved(te)
        for e, x, d in zip(timed, a.tolist(), (b - a).tolist()):
            e["ts"] = x
            e["dur"] = d
        for e, x in zip(instant, moved(ti).tolist()):
            e["ts"] = x
        out = {k: v for k, v in doc.items() if k != "traceEvents"}
        out["baseTimeNanoseconds"] = base + self.tim.clock(r)
        di = doc.get("distributedInfo")
        if isinstance(di, dict):
            di = dict(di, rank=r, world_size=self.lay.n)
            di["pg_config"] = [dict(g, ranks=self.lay.members(g["ranks"], r),
                                    pg_size=len(self.lay.members(g["ranks"], r)))
                               if isinstance(g, dict) and isinstance(g.get("ranks"), list) else g
                               for g in di.get("pg_config") or []]
            out["distributedInfo"] = di
        if "host_name" in out:
            out["host_name"] = self.lay.host(r)
        out["traceEvents"] = doc["traceEvents"]  # its events now hold r's times
        data = orjson.dumps(out) if "orjson" in globals() else json.dumps(out).encode()
        return gzip.compress(data, compresslevel=1, mtime=0)

    # -- the whole run
    def write_rank(self, r: int) -> None:
        s = self.lay.source_of(r)
        d = self.out / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        rel = f"ranks/rank-{r:05d}"
        (d / "meta.json").write_bytes(_dumps_indent(self._meta(r, s)))
        self.files.append(f"{rel}/meta.json")
        for name, recs in self.src.ranks[s]["streams"].items():
            if name == "collectives":
                text = self._collectives(r, s)
            elif name == "steps":
                text = self._steps(r, s)
            elif name == "clock":
                text = self._clock_stream(r, s)
            elif name == "groups":
                text = "".join(_dumps(_sized(self._map_times(r, s, x))) + "\n" for x in recs)
            else:
                text = "".join(_dumps(self._map_times(r, s, x)) + "\n" for x in recs)
            (d / f"{name}.jsonl").write_text(text)
            self.files.append(f"{rel}/{name}.jsonl")
        for name, data in self.src.ranks[s]["files"].items():
            (d / name).write_bytes(data)
            self.files.append(f"{rel}/{name}")
        if r in self.traced:
            p = self.out / "profiler" / f"rank-{r:05d}.pt.trace.json.gz"
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(self._trace(r, s))
            self.files.append(f"profiler/{p.name}")

    def write_root(self) -> None:
        src, lay, n = self.src, self.lay, self.lay.n
        end_shift = int(self.tim.G[-1])
        man = dict(src.manifest)
        man.update(world_size=n, ranks_seen=n, host=lay.host(0))
        if isinstance(man.get("mesh"), dict):
            man["mesh"] = dict(man["mesh"], shape=list(lay.shape))
        if isinstance(man.get("end_time"), dict) and isinstance(man["end_time"].get("ns"), int):
            man["end_time"] = dict(man["end_time"], ns=man["end_time"]["ns"] + end_shift)
        if isinstance(man.get("command"), list):
            man["command"] = _command(man["command"], n, lay)
        man["ranks"] = [{"rank": r, "host": lay.host(r), "local_rank": r % lay.per_host,
                         "pid": self._pid(r), "device": src.ranks[lay.source_of(r)]["meta"].get("device"),
                         "device_name": src.ranks[lay.source_of(r)]["meta"].get("device_name"),
                         "coords": lay.coords_dict(r, src.ranks[lay.source_of(r)]["meta"].get("coords") or {})}
                        for r in range(n)]
        if src.worker_exits:
            lines = []
            for h in range((n + lay.per_host - 1) // lay.per_host):
                for rec in src.worker_exits:
                    new = dict(rec, host=f"node{h:03d}")
                    if isinstance(rec.get("agent_pid"), int):
                        new["agent_pid"] = 50000 + h
                    if isinstance(rec.get("t_ns"), int):
                        new["t_ns"] = rec["t_ns"] + end_shift
                    if isinstance(rec.get("workers"), list) and rec["workers"]:
                        tpl = rec["workers"][0]
                        new["workers"] = [dict(tpl, rank=r, local_rank=r % lay.per_host, pid=self._pid(r))
                                          for r in range(h * lay.per_host, min(n, (h + 1) * lay.per_host))]
                    lines.append(_dumps(new))
            (self.out / "worker-exits.jsonl").write_text("\n".join(lines) + "\n")
            self.files.append("worker-exits.jsonl")
        inj = []
        if self.straggler is not None:
            inj.append({"kind": "straggler", "params": {"rank": self.straggler,
                                                        "delay_ms": self.delay_ms, "from_step": 0},
                        "coords": lay.coords_dict(self.straggler, src.ranks[lay.source_of(self.straggler)]["meta"].get("coords") or {})})
        names = src.dim_names
        layout = {k: int(v) for k, v in zip(names, lay.shape)}
        (self.out / "injected.json").write_bytes(_dumps_indent({
            "schema_version": 1, "injections": inj, "layout": layout,
            "synthesized": {"source": str(src.path), "source_ranks": src.S, "ranks": n,
                            "traced_ranks": self.traced, "ranks_per_host": lay.per_host,
                            "job_extra_ms_per_step": (self.tim.X / 1e6).round(3).tolist(),
                            "host_clock_offsets_ms": (self.tim.host_off[:16] / 1e6).round(3).tolist()}}))
        self.files.append("injected.json")
        if src.nodes:  # one launcher record per node, as each node's `trainprof wrap` writes
            (self.out / "nodes").mkdir()
            tpl = src.nodes[0]
            by_rank: dict[int, list[str]] = {}
            for f in self.files:  # ranks/rank-NNNNN/... and profiler/rank-NNNNN.*
                if f.startswith(("ranks/rank-", "profiler/rank-")):
                    by_rank.setdefault(int(f.split("rank-")[1][:5]), []).append(f)
            for h in range((n + lay.per_host - 1) // lay.per_host):
                ranks = list(range(h * lay.per_host, min(n, (h + 1) * lay.per_host)))
                name = f"node{h:03d}-{50000 + h}"
                files = [f"nodes/{name}.json"] + [f for r in ranks for f in by_rank.get(r, [])]
                rec = dict(tpl, ranks=ranks, node=name, host=lay.host(ranks[0]), launcher_pid=50000 + h,
                           files=sorted(files + (["manifest.json", "injected.json"] if h == 0 else [])))
                if isinstance(tpl.get("command"), list):
                    rec["command"] = _command(tpl["command"], n, lay)
                if isinstance(tpl.get("end_time"), dict) and isinstance(tpl["end_time"].get("ns"), int):
                    rec["end_time"] = dict(tpl["end_time"], ns=tpl["end_time"]["ns"] + end_shift)
                (self.out / "nodes" / f"{name}.json").write_bytes(_dumps_indent(rec))
                self.files.append(f"nodes/{name}.json")
        man["files"] = sorted(self.files)
        (self.out / "manifest.json").write_bytes(_dumps_indent(man))


def _sized(g: dict) -> dict:
    """A groups.jsonl record whose member list changed: its size follows."""
    if isinstance(g.get("ranks"), list) and isinstance(g.get("size"), int):
        g["size"] = len(g["ranks"])
    return g


def _command(cmd: list, n: int, lay: Layout) -> list:
    """The source's torchrun command as it would read on N ranks (8 per node)."""
    out, i = [], 0
    while i < len(cmd):
        a = str(cmd[i])
        if a in ("--nproc-per-node", "--nproc_per_node") and i + 1 < len(cmd):
            out += [a, str(min(n, lay.per_host)), "--nnodes", str((n + lay.per_host - 1) // lay.per_host)]
            i += 2
            continue
        if a == "--standalone":
            out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lay.host(0)}:29500"]
            i += 1
            continue
        if a == "--dp" and i + 1 < len(cmd):
            out += [a, str(lay.shape[0])]
            i += 2
            continue
        out.append(cmd[i])
        i += 1
    return out


def traced_ranks(src: Source, lay: Layout, k: int) -> list[int]:
    """k evenly spaced ranks (rank 0 first) whose source rank has a trace."""
    if k <= 0 or not src.traces:
        return []
    out: list[int] = []
    for i in range(min(k, lay.n)):
        r = i * lay.n // min(k, lay.n)
        while r < lay.n and (lay.source_of(r) not in src.traces or r in out):
            r += 1
        if r < lay.n:
            out.append(r)
    return sorted(out)


def synthesize(out, ranks: int, source=None, traces: int = 8, straggler: int | None = None,
               delay_ms: float = 0.0, jitter: float = 0.03, ranks_per_host: int = RANKS_PER_HOST,
               clock_skew_ms: float = 2.0, seed: int = 0, force: bool = False,
               quiet: bool = True) -> Path:
    """Write an N-rank run directory synthesized from ``source`` into ``out``; returns it."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists():
        if not force and any(out.iterdir()):
            raise SystemExit(f"{out}: exists and is not empty (--force replaces it)")
        shutil.rmtree(out)
    src = Source(load_source(source))
    lay = Layout(src, int(ranks), ranks_per_host)
    if straggler is not None and not 0 <= straggler < lay.n:
        raise SystemExit(f"--straggler {straggler}: not a rank of {lay.n}")
    tim = Timing(lay, jitter, straggler, delay_ms, clock_skew_ms, seed)
    w = Writer(src, lay, tim, out, traced_ranks(src, lay, traces), straggler, delay_ms)
    out.mkdir(parents=True)
    for r in range(lay.n):
        w.write_rank(r)
    w.write_root()
    if not quiet:
        print(f"{out}: {lay.n} ranks (mesh {lay.shape}) from {src.path} ({src.S} ranks), "
              f"{len(w.traced)} with traces, straggler {straggler} (+{delay_ms} ms); "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--traces", type=int, default=8, help="ranks that keep a profiler trace")
    ap.add_argument("--straggler", type=int, default=None, help="rank made slow")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="the straggler's extra work per step")
    ap.add_argument("--source", default=None, help="source run directory or .tar.gz "
                                                   "(default: tests/fixtures/scale/dp4-run.tar.gz)")
    ap.add_argument("--jitter", type=float, default=0.03, help="per-rank per-step work jitter (fraction of a step)")
    ap.add_argument("--ranks-per-host", type=int, default=RANKS_PER_HOST)
    ap.add_argument("--clock-skew-ms", type=float, default=2.0, help="host clock offsets up to ± this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace OUT")
    a = ap.parse_args(argv)
    if a.straggler is not None and a.delay_ms <= 0:
        ap.error("--straggler needs --delay-ms > 0")
    synthesize(a.out, a.ranks, a.source, a.traces, a.straggler, a.delay_ms, a.jitter,
               a.ranks_per_host, a.clock_skew_ms, a.seed, a.force, quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
