"""RunDir: the analysis's reader of its input — a run directory (the only contract between
capture and analysis), several of one job, bare profiler traces or allocator snapshots.

Run directory layout (schema version 1, documented in docs/run-directory.md)::

    RUN/
      manifest.json                      written by the launcher (`trainprof wrap`) at start and end
      ranks/rank-00000/meta.json         written by each rank's probes when they activate
      ranks/rank-00000/<stream>.jsonl    append-only per-rank streams (steps, collectives, ...)
      profiler/rank-00000.pt.trace.json.gz   torch.profiler Chrome traces (HTA-loadable folder)
      digests/rank-00000.json            each trace reduced for job-level analysis (trainprof/analysis/digest.py)
      summary.json, report.html          written by `trainprof analyze`

The run directory itself is defined in trainprof/rundir/: its file names, writers (used inside
training processes: standard library only, never raising into the job) and readers of single
files (files.py), the record types of every stream (schema.py) and the stream decoders
(streams.py). RunDir is built on those and lives with the analysis because reading a run's
traces means digesting them (trainprof/analysis/digest.py runs analyzers over each trace): what
an input is and bare profiler traces (inputs.py) and a run's profiler traces (traces.py) are its
parts. Readers tolerate a torn last line and report every other defect with the file it came
from; they read only regular files within the input limits (trainprof/safeio.py), check every
record against the documented field types, check the world size against the ranks present, and
refuse a run directory of a newer schema (SchemaVersionError).
"""

from __future__ import annotations

import collections
import math
import os
import stat
from pathlib import Path
from typing import Any

from trainprof.rundir import (schema as rundir_schema, series as rundir_series,
                              streams as rundir_streams)
from trainprof import safeio
from trainprof.rundir.files import (
    FATAL_STACKS, INJECTED, JOB_TRACES_DIR, MANIFEST, MAX_FATAL_STACKS_BYTES, MAX_WORKER_EXITS_BYTES,
    NOT_SNAPSHOTS, SNAPSHOT_SUFFIXES, TRACE_SUFFIXES, MAX_PROBLEMS_PER_FILE, META, PROFILER_DIR, RANKS_DIR,
    REPORT, SCHEMA_VERSION, STEPS, SUMMARY, JsonlWriter, RunDirError, SchemaVersionError, _exists,
    _is_dir, _listdir, close_quietly, collect_rank_entries, dumps_compact, is_job_trace_name,
    iter_jsonl, job_trace_dir, profiler_trace_path, rank_dir, rank_dirname, read_json,
    write_json_atomic)
from trainprof.analysis.inputs import RunDirInputs
from trainprof.analysis.traces import RunDirTraces
from trainprof.rankranges import ranges
from trainprof.rundir.worker_exits import STREAM, summarize
from trainprof.meshinfo import group_coords
from trainprof.rundir.health import outside_link
from trainprof.rundir.streams import read_records

__all__ = [
    "FATAL_STACKS", "INJECTED", "JOB_TRACES_DIR", "MANIFEST", "MAX_ABSENT_EXTRA",
    "MAX_ABSENT_FACTOR", "MAX_FATAL_STACKS_BYTES", "MAX_PROBLEMS_PER_FILE",
    "MAX_WORKER_EXITS_BYTES", "META", "NOT_SNAPSHOTS", "PROFILER_DIR", "RANKS_DIR", "REPORT",
    "SCHEMA_VERSION", "SNAPSHOT_SUFFIXES", "STEPS", "SUMMARY", "TRACE_SUFFIXES", "JsonlWriter",
    "RunDir", "RunDirError", "SchemaVersionError", "close_quietly", "collect_rank_entries",
    "dumps_compact", "is_job_trace_name", "iter_jsonl", "job_trace_dir", "profiler_trace_path",
    "rank_dir", "rank_dirname", "read_json", "write_json_atomic"]

MAX_ABSENT_FACTOR, MAX_ABSENT_EXTRA = 4, 64  # a world size is trusted up to 4 x ranks present + 64


def _rank_from_name(name: str) -> int | None:
    """rank-00003_x.pickle, rank3.pickle, snapshot_rank_3.pickle -> 3; else None."""
    import re

    m = re.search(r"rank[-_]?(\d+)", name)
    return int(m.group(1)) if m else None




def _host_map(hosts: dict, wanted: set) -> dict[int, str]:
    """{"node001": "8-15,24"} (meta.json ``hosts``) -> {rank: host} for the ranks in wanted."""
    out: dict[int, str] = {}
    for h, spec in hosts.items():
        if not isinstance(spec, str):
            continue
        for part in spec.split(","):
            a, _, b = part.partition("-")
            if a.isdigit() and (not b or b.isdigit()):
                lo, hi = int(a), int(b or a)
                out.update((r, str(h)) for r in wanted if lo <= r <= hi)
    return out


class RunDir(RunDirInputs, RunDirTraces):
    """Read-side view of a run directory. Everything is loaded lazily and cached, so all
    analyzers share one parse of each file (profiler traces included)."""

    def __init__(self, path: str | os.PathLike | list | tuple, _preset: dict | None = None):
        # ``_preset``: cache entries known already (trainprof/analysis/digest.py's view of one bare trace)
        # several inputs (trace files or folders of traces) are analyzed as one job
        inputs = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
        if not inputs:
            raise RunDirError("no input given")
        self.path = inputs[0]
        # Bare allocator snapshots (torch.cuda.memory._dump_snapshot pickles), given as one file
        # or a folder of them, are analysed as a "run" that holds nothing else.
        self.bare_snapshots: list[Path] = []
        # Bare torch.profiler traces (a folder of them, files, or several of those), analysed as
        # a run that holds only traces (trainprof/trace/_discover.py finds their ranks).
        self.trace_inputs: list[Path] = []
        self.input_facts: dict = {}
        self.problems: list[str] = []
        self._cache: dict[str, Any] = dict(_preset or {})
        self._unreadable: set[int] = set()  # rank folders that cannot be read (said once)
        # several run directories of one job (a per-node --out each) are analyzed as one run:
        # ``roots`` are those directories, ``_rank_roots`` says which one holds a rank's files
        self.roots: list[Path] = [self.path]
        self._rank_roots: dict[int, Path] = {}
        if len(inputs) > 1 and all(_is_dir(p) and (_exists(p / MANIFEST) or _is_dir(p / RANKS_DIR))
                                   for p in inputs):
            self._several_run_dirs(inputs)
        elif len(inputs) > 1:
            self._bare_trace_inputs(inputs)
        else:
            self._classify(self.path)
        self.launcher  # noqa: B018 - read now: a newer schema is refused before any analysis
        self._census()

    def rank_path(self, rank: int) -> Path:
        """ranks/rank-N of the run directory that holds the rank (several with per-node dirs)."""
        return rank_dir(self._rank_roots.get(rank, self.path), rank)

    @property
    def snapshot_only(self) -> bool:
        """True when this "run" is bare allocator snapshots (no ranks, streams or traces)."""
        return bool(self.bare_snapshots)

    # -- allocator snapshots
    def snapshot_files(self) -> list[tuple[int | None, Path]]:
        """(rank or None, path) of every allocator snapshot: the bare files, or the ones the
        memory probe wrote into ranks/rank-N/ (memory_snapshot.pickle, oom_snapshot.pickle)."""
        if self.bare_snapshots:
            return [(_rank_from_name(p.name), p) for p in self.bare_snapshots]
        out = []
        for r in self.ranks:
            d = self.rank_path(r)
            if _is_dir(d):
                out += [(r, p) for p in _listdir(d, self.problems)
                        if p.name.endswith(SNAPSHOT_SUFFIXES) and not p.name.startswith(NOT_SNAPSHOTS)]
        return out

    def snapshot(self, path: Path):
        """The parsed snapshot (trainprof.formats.snapshot.Snapshot), loaded once with the restricted
        unpickler; None (and a problem naming the file) when it cannot be read."""
        key = f"snapshot:{path}"
        if key not in self._cache:
            # lazy: start-up time of analyze
            from trainprof.formats.snapshot import SnapshotError, load_snapshot

            try:
                self._cache[key] = load_snapshot(path)
            except SnapshotError as e:
                self.problems.append(str(e))
                self._cache[key] = None
        return self._cache[key]

    # -- manifest and ranks
    @property
    def launcher(self) -> dict:
        """manifest.json as the launcher wrote it ({} when missing, e.g. a probe-only run), its
        wrongly typed fields dropped (each a problem). A newer schema_version, or one that is not
        a version number, raises SchemaVersionError."""
        if "launcher" not in self._cache:
            p = self.path / MANIFEST
            man: dict = {}
            if not self.bare_snapshots and not self.trace_inputs and _exists(p, self.problems):
                try:
                    raw = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
                    raw = {}
                if not isinstance(raw, dict):
                    self.problems.append(f"{p}: expected a JSON object, not {type(raw).__name__}; ignored")
                    raw = {}
                if raw.get("schema_version") is not None:
                    raw = dict(raw, schema_version=self._schema_version(p, raw["schema_version"]))
                man = rundir_schema.clean_object(rundir_schema.MANIFEST, raw, str(p), self.problems,
                                                 rundir_schema.MANIFEST_NESTED)
            if not self.bare_snapshots and not self.trace_inputs:
                man = self._merge_nodes(man)
            self._cache["launcher"] = man
        return self._cache["launcher"]

    def _merge_nodes(self, man: dict) -> dict:
        """The launcher records of every node (RUN/nodes/*.json of each run directory; with
        several run directories, the manifest.json of one without node records stands for its
        node) merged over the first manifest (trainprof/rundir/nodes.py merge)."""
        from trainprof.rundir import nodes  # lazy: start-up time of analyze

        def clean(rec, where):
            return rundir_schema.clean_object(rundir_schema.NODE, rec, where, self.problems,
                                              rundir_schema.MANIFEST_NESTED)

        several = len(self.roots) > 1
        records = []
        for i, root in enumerate(self.roots):
            recs = nodes.read_records(root, self.problems, clean)
            for r in recs:
                r["_file"] = str(root / r["_file"]) if several else r["_file"]
            if not recs and several:
                other = man if i == 0 else self._other_manifest(root / MANIFEST)
                if other:
                    recs = [dict(other, _file=str(root / MANIFEST),
                                 ranks=[e["rank"] for e in other.get("ranks") or []
                                        if isinstance(e, dict) and type(e.get("rank")) is int])]
            records += recs
        return nodes.merge(man, records)

    def _other_manifest(self, p: Path) -> dict:
        """manifest.json of another run directory of the job (several run directories)."""
        if not _exists(p, self.problems):
            return {}
        try:
            raw = read_json(p)
        except RunDirError as e:
            self.problems.append(str(e))
            return {}
        if not isinstance(raw, dict):
            return {}
        if raw.get("schema_version") is not None:
            raw = dict(raw, schema_version=self._schema_version(p, raw["schema_version"]))
        return rundir_schema.clean_object(rundir_schema.MANIFEST, raw, str(p), self.problems,
                                          rundir_schema.MANIFEST_NESTED)

    def _schema_version(self, p: Path, v) -> int:
        if type(v) is str and v.strip().isdigit() and len(v.strip()) < 10:
            self.problems.append(f'{p}: "schema_version" is the string {v!r}, read as {int(v)}')
            v = int(v)
        if type(v) is not int or v < 1:
            raise SchemaVersionError(
                f"{p}: schema_version {str(v)[:40]!r} is not a version number; this trainprof "
                f"reads run directories of schema version 1 to {SCHEMA_VERSION}: refused")
        if v > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{p}: schema_version {v} is newer than this trainprof reads ({SCHEMA_VERSION}); "
                f"upgrade trainprof to analyze it: refused")
        return v

    @property
    def ranks(self) -> list[int]:
        """Ranks with files: a readable ranks/rank-N directory or a profiler trace."""
        if "ranks" not in self._cache:
            if self.bare_snapshots:
                self._cache["ranks"] = []
                self._cache["rank_dirs"] = set()
                return []
            found: set[int] = set()
            for root in self.roots if not self.trace_inputs else ():
                self._rank_dirs_of(root, found)
            self._cache["rank_dirs"] = set(found)
            found.update(self.profiler_traces().keys())
            self._cache["ranks"] = sorted(found)
        return self._cache["ranks"]

    def _rank_dirs_of(self, root: Path, found: set[int]) -> None:
        """Add the readable ranks/rank-N folders of one run directory to ``found``; a rank
        already found in another run directory is refused (RunDirError naming both)."""
        rd = root / RANKS_DIR
        if not _is_dir(rd):
            return
        for d in _listdir(rd, self.problems):
            if not d.name.startswith("rank-") or not _is_dir(d):
                continue
            num = d.name[5:]
            if not (num.isdigit() and len(num) <= 9):
                self.problems.append(f"{d}: unexpected folder name, ignored")
                continue
            if not os.access(d, os.R_OK | os.X_OK):
                self.problems.append(f"{d}: cannot read (permission denied); rank "
                                     f"{int(num)}'s files are not analyzed")
                self._unreadable.add(int(num))
                continue
            if int(num) in found and len(self.roots) > 1:
                raise RunDirError(f"rank {int(num)} is in two run directories: "
                                  f"{self.rank_path(int(num))} and {d}; analyze together "
                                  f"only run directories holding different ranks")
            found.add(int(num))
            if len(self.roots) > 1:
                self._rank_roots[int(num)] = root

    def rank_meta(self, rank: int) -> dict:
        """ranks/rank-N/meta.json ({} when missing), its wrongly typed fields dropped (each a
        problem naming the file and the field)."""
        key = f"meta:{rank}"
        if key not in self._cache and self.trace_inputs:
            self._cache[key] = self._trace_meta(rank)
        if key not in self._cache:
            p = self.rank_path(rank) / META
            meta: dict = {}
            if _exists(p, self._problems_of(rank)):
                try:
                    raw = read_json(p)
                except RunDirError as e:
                    self.problems.append(str(e))
                    raw = {}
                if isinstance(raw, dict):
                    meta = rundir_schema.clean_object(rundir_schema.META, raw, str(p), self.problems,
                                                      rundir_schema.META_NESTED)
                else:
                    self.problems.append(f"{p}: expected a JSON object, not {type(raw).__name__}; ignored")
                if meta.get("rank") is not None and meta["rank"] != rank:
                    self.problems.append(f"{p}: says rank {meta['rank']} but lives in "
                                         f"{rank_dirname(rank)}; the folder's rank is used")
            self._cache[key] = meta
        return self._cache[key]

    # -- world size and completeness
    def _census(self) -> dict:
        """World size checked against the ranks present, and the ranks missing. A world size
        is taken from the files (each rank's meta.json, the manifest) only when they agree with
        each other and with the ranks present; it is never trusted beyond 4x the ranks present
        + 64 (a loop bound for the analyses). One problem line per inconsistency."""
        if "census" in self._cache:
            return self._cache["census"]
        ranks = self.ranks
        claims: dict[int, list[str]] = {}
        for r in ranks:
            ws = self.rank_meta(r).get("world_size")
            if ws is not None:
                claims.setdefault(ws, []).append(self._meta_source(r))
        ws = self.launcher.get("world_size")
        if ws is not None:
            claims.setdefault(ws, []).append(MANIFEST)
        declared = None
        if claims:
            declared = max(claims, key=lambda w: (len(claims[w]), -w))
            if len(claims) > 1:
                said = "; ".join(f"{', '.join(srcs[:2])}{' …' if len(srcs) > 2 else ''} say {w}"
                                 for w, srcs in sorted(claims.items(), key=lambda kv: -len(kv[1])))
                self.problems.append(f"{self.path}: the files disagree on the world size ({said}); "
                                     f"using {declared}")
        n = len(ranks)
        top = (max(ranks) + 1) if ranks else 0
        bound = MAX_ABSENT_FACTOR * n + MAX_ABSENT_EXTRA
        if declared is not None and top > declared:
            self.problems.append(f"{self.path}: rank {top - 1} has files but the world size is "
                                 f"{declared}; using {top}")
            declared = top
        if declared is not None and declared > bound:
            self.problems.append(
                f"{self.path}: world size {declared} but only {n} rank(s) have files: not trusted "
                f"(at most {bound} for {n} rank(s) present); analyzing the ranks present, "
                f"job-level figures are partial")
            world = top if top <= bound else n
        else:
            world = declared if declared is not None else n
        have = (self._cache.get("rank_dirs", set()) if not self.trace_inputs
                and any(_is_dir(root / RANKS_DIR) for root in self.roots) else set(ranks))
        # without a declared world size nothing says which ranks should be there
        missing = [r for r in range(world) if r not in have] if declared is not None else []
        absent = max(0, (declared or 0) - world) + len(missing)
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", …" if len(missing) > 10 else "")
            where = ("no trace" if self.trace_inputs else f"{RANKS_DIR}/{rank_dirname(missing[0])}"
                     f"{' …' if len(missing) > 1 else ''} missing")
            self.problems.append(
                f"{self.path}: world size {world}, {world - len(missing)} rank(s) present; "
                f"missing: {self._missing_where(missing, have)} — {len(missing)} of {world} "
                f"rank(s) have no readable files ({where}): rank(s) {shown}; job-level figures "
                f"that need every rank (step time, MFU, pipeline bubble, ...) are partial or withheld")
        shape = self.mesh.get("shape") or []
        if shape and declared is not None and math.prod(shape) != declared:
            self.problems.append(f"{self.path}: the DeviceMesh {shape} holds {math.prod(shape)} "
                                 f"ranks but the world size is {declared}")
        self._cache["census"] = {"world_size": world, "declared": declared, "missing": missing,
                                 "absent": absent}
        return self._cache["census"]

    def _missing_where(self, missing: list[int], have) -> str:
        """"8–15 (host node001), 40 (host unknown)": missing ranks as compact ranges with the
        host each ran on, where known: from the torchrun agents' worker-exits.jsonl, else from
        a present rank of the same node (torchrun numbers each node's ranks contiguously:
        rank // local world size), else from the only node record without ranks."""
        host: dict[int, str] = {}
        try:
            for r, row in summarize(self.worker_exits()).get("workers", {}).items():
                if row.get("host") and row["host"] != "None":
                    host[r] = row["host"]
        except Exception:  # noqa: BLE001 - a hint only
            pass
        local_ws, by_group, mapped = None, {}, False
        present = sorted(have)[:4096]  # a bounded sample is enough to place whole nodes
        for r in present:
            meta = self.rank_meta(r)
            if isinstance(meta.get("hosts"), dict) and not mapped:  # probes/hostmap.py
                mapped = True
                for k, h in _host_map(meta["hosts"], set(missing)).items():
                    host.setdefault(k, h)
            env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
            lws = env.get("LOCAL_WORLD_SIZE")
            if local_ws is None and isinstance(lws, str) and lws.isdigit() and int(lws) > 0:
                local_ws = int(lws)
            if local_ws and meta.get("host"):
                by_group.setdefault(r // local_ws, meta["host"])
        nodes_without = [n.get("host") for n in self.launcher.get("nodes") or []
                         if not n.get("ranks") and n.get("host")]
        groups: dict[str, list[int]] = {}
        for r in missing:
            h = host.get(r) or (by_group.get(r // local_ws) if local_ws else None) \
                or (nodes_without[0] if len(nodes_without) == 1 else None)
            groups.setdefault(h or "unknown", []).append(r)
        parts = [(min(rs), ranges(rs, "–") + (f" (host {h})" if h != "unknown" else ""))
                 for h, rs in groups.items()]
        text = ", ".join(t for _, t in sorted(parts))
        return text if len(text) < 600 else text[:600] + " …"

    def _meta_source(self, rank: int) -> str:
        """Where a rank's facts come from, for problem lines."""
        if self.trace_inputs:
            p = self.profiler_traces().get(rank)
            return p.name if p else f"rank {rank}'s trace"
        return f"{RANKS_DIR}/{rank_dirname(rank)}/{META}"

    @property
    def world_size(self) -> int:
        """The job's world size as far as the files can be trusted (see _census)."""
        return self._census()["world_size"]

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the job without readable files (rank directory absent or unreadable)."""
        return list(self._census()["missing"])

    def partial(self) -> dict | None:
        """None when every rank of the job has files; else what job-level figures should say:
        {"world_size", "ranks_present", "missing_ranks" (first 50), "missing_count"}."""
        c = self._census()
        if not c["absent"]:
            return None
        return {"world_size": max(c["declared"] or 0, c["world_size"]),
                "ranks_present": len(self.ranks), "missing_ranks": c["missing"][:50],
                "missing_count": c["absent"]}

    def profiled(self) -> dict | None:
        """Which ranks recorded the profiler window, as each rank decided by --profile-ranks
        (meta.json ``profiled``, ``profile_policy``, ``profile_ranks``): {"count", "of" (the
        world size), "ranks" (the first 256), "ranges", "policy", "spec", "not_profiled" (ranks
        that skipped it on purpose), "text"}; None when no rank recorded a decision."""
        yes, no, policies, specs = [], 0, collections.Counter(), collections.Counter()
        for r in self.ranks:
            m = self.rank_meta(r)
            if m.get("profiled") is None:
                continue
            if m["profiled"]:
                yes.append(r)
            else:
                no += 1
            policies[m.get("profile_policy") or "?"] += 1
            specs[m.get("profile_ranks") or "?"] += 1
        if not yes and not no:
            return None

        policy = policies.most_common(1)[0][0]
        return {"count": len(yes), "of": self.world_size, "ranks": yes[:256],
                "ranges": ranges(yes), "policy": policy, "spec": specs.most_common(1)[0][0],
                "not_profiled": no,
                "text": f"{len(yes)} of {self.world_size} rank{'s' * (self.world_size != 1)} "
                        f"profiled (policy {policy})"}

    @property
    def mesh(self) -> dict:
        """{"dim_names": [...], "shape": [...]} of the job's DeviceMesh ({} when none)."""
        for r in self.ranks:
            m = self.rank_meta(r).get("mesh")
            if m and m.get("dim_names"):
                return {"dim_names": m["dim_names"], "shape": m["shape"]}
        return {}

    def coords(self, rank: int) -> dict:
        """Mesh coordinates of a rank, e.g. {"dp": 1, "pp": 0, "tp": 1} ({} when unknown);
        without a DeviceMesh, from its labelled process groups (plain DDP: {"dp": i})."""
        got = self.rank_meta(rank).get("coords")
        if got or self.trace_inputs:
            return dict(got or {})

        return group_coords(self.stream(rank, "groups"), rank)

    def hang_dump(self, path: Path):
        """A hang dump (ranks/rank-N/hang-dump.json) with its wrongly typed fields dropped (each
        a problem); RunDirError when it cannot be read; a non-object is returned as it is."""
        doc = read_json(path)
        if not isinstance(doc, dict):
            return doc
        return rundir_schema.clean_object(rundir_schema.HANG_DUMP, doc, str(path), self.problems,
                                          rundir_schema.HANG_DUMP_NESTED)

    def fatal_stacks(self, rank: int) -> str | None:
        """ranks/rank-N/fatal-stacks.txt (probes/fatal_dump.py: faulthandler's dump of a rank
        killed by a fatal signal), or None when absent; past MAX_FATAL_STACKS_BYTES its header
        line and its last bytes (the newest dump), with a problem."""
        p = self.rank_path(rank) / FATAL_STACKS
        if not _exists(p, self._problems_of(rank)):
            return None
        try:
            fd, size = safeio.open_regular(p)
        except (OSError, safeio.InputRefused) as e:
            self.problems.append(f"{p}: {e}" if str(p) not in str(e) else str(e))
            return None
        with open(fd, "rb") as f:
            if size <= MAX_FATAL_STACKS_BYTES:
                data = f.read(MAX_FATAL_STACKS_BYTES)
            else:
                head = f.readline(1024)
                f.seek(size - MAX_FATAL_STACKS_BYTES)
                data = head + f.read(MAX_FATAL_STACKS_BYTES)
                self.problems.append(f"{p}: {size} bytes, over the {MAX_FATAL_STACKS_BYTES} read; "
                                     "its last bytes used")
        return data.decode("utf-8", "replace")

    def worker_exits(self) -> list[dict]:
        """The records of RUN/worker-exits.jsonl (how the launcher's workers ended); [] when it
        is absent, not a regular file or too large (each a problem)."""
        out: list[dict] = []
        for p in [root / STREAM for root in self.roots]:
            try:
                st = os.stat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                self.problems.append(f"{p}: not a regular file, ignored")
                continue
            if st.st_size > MAX_WORKER_EXITS_BYTES:
                self.problems.append(f"{p}: {st.st_size} bytes, over the {MAX_WORKER_EXITS_BYTES} "
                                     "read; ignored")
                continue
            out += iter_jsonl(p, self.problems)
        return out

    def rank_file(self, rank: int, name: str) -> Path | None:
        """ranks/rank-N/NAME if it exists (None also when it cannot be checked, with a problem)."""
        p = self.rank_path(rank) / name
        return p if _exists(p, self._problems_of(rank)) else None

    def _problems_of(self, rank: int) -> list[str] | None:
        """Where to say that a rank's file cannot be checked: nowhere when its whole folder
        was already said to be unreadable."""
        return None if rank in self._unreadable else self.problems

    # -- streams
    def stream_path(self, rank: int, name: str) -> Path:
        return self.rank_path(rank) / f"{name}.jsonl"

    def stream_file_ok(self, rank: int, p: Path) -> bool:
        """Whether a rank's stream file exists and may be read: a symbolic link that leads out
        of the run directory is refused (a problem naming it and its target), never read."""
        if not _exists(p, self._problems_of(rank)):
            return False

        why = outside_link(p, self._rank_roots.get(rank, self.path))
        if why and why not in self.problems:
            self.problems.append(why)
        return why is None

    def stream(self, rank: int, name: str) -> list[dict]:
        """A rank's records of a stream, checked against the documented field types (bad
        records skipped, each a problem with file and line)."""
        key = f"stream:{name}:{rank}"
        if key not in self._cache:
            self._cache[key] = self._ring_records(rank, name, read_records)
        return self._cache[key]

    def _ring_records(self, rank: int, name: str, read_records) -> list[dict]:
        """A stream's records: ``<name>.prev.jsonl`` (the older half of a ring, bounded
        capture) then ``<name>.jsonl``."""
        if name == "collectives":  # bounded capture: the newest detail (rundir/series.py)
            if rundir_series.has_compact(self, rank):
                return rundir_series.ring_tail(self, rank, name)[0]
        out: list[dict] = []
        for p in (self.rank_path(rank) / f"{name}.prev.jsonl", self.stream_path(rank, name)):
            if p.name.endswith(".prev.jsonl") and not os.path.lexists(p):
                continue
            if self.stream_file_ok(rank, p):
                out += read_records(p, self.problems, name,
                                    self._cache.setdefault("shared_lists", {}))
        return out

    def frame(self, name: str):
        """All ranks' records of a stream as one pandas DataFrame with a ``rank`` column (built
        column by column, without keeping every rank's records: trainprof/rundir/streams.py).
        Without any rank directory (bare traces, allocator snapshots) no stream exists: an
        empty stand-in (rundir_streams.NO_RECORDS) that answers ``.empty`` without pandas."""
        key = f"frame:{name}"
        if key not in self._cache:
            if not self._has_rank_dirs():
                self._cache[key] = rundir_streams.NO_RECORDS
            elif name in rundir_series.COMPACT_STREAMS and rundir_series.any_compact(self):
                self._cache[key] = rundir_series.stream_frame(self, name)  # bounded format
            else:
                self._cache[key] = rundir_streams.build_frame(self, name)
        return self._cache[key]

    def _has_rank_dirs(self) -> bool:
        """Whether any rank has a readable ranks/rank-N folder (where its streams live)."""
        self.ranks  # noqa: B018 - finds the rank folders
        return bool(self._cache.get("rank_dirs"))

    def stream_once(self, rank: int, name: str) -> list[dict]:
        """stream(), without keeping the records for other readers: for a stream one analyzer
        reads (at 1,000 ranks every rank's records held at once cost hundreds of MB)."""
        key = f"stream:{name}:{rank}"
        if key in self._cache:
            return self._cache[key]

        return self._ring_records(rank, name, read_records)

    def stream_tail(self, rank: int, name: str) -> dict | None:
        """A rank's last record of a stream (None when it has none), without caching the
        whole stream when only its frame was read."""
        key = f"stream:{name}:{rank}"
        if key in self._cache or f"frame:{name}" not in self._cache:
            recs = self.stream(rank, name)
            return recs[-1] if recs else None
        return self._cache.get("tails:" + name, {}).get(rank)

    def collectives(self):
        """The training job's collectives (frame of collectives.jsonl), without those a NaN
        replay issued (``"replay": true``: rerun on saved inputs after a detection; the hang
        post-mortem reads the raw stream, where they stay)."""
        key = "frame:collectives:job"
        if key not in self._cache:
            df = self.frame("collectives")
            if "replay" in df.columns:
                df = df[df["replay"].ne(True)].reset_index(drop=True)

            df = rundir_series.common_detail(self, df)  # rings: the steps every rank holds
            self._cache[key] = df
        return self._cache[key]

    def steps(self):
        """Per-rank step records: rank, step, start_ns, end_ns, dur_ms, source."""
        return self.frame(STEPS)

    # -- per-step series (trainprof/rundir/series.py): the same for either run-directory format
    def collective_steps(self):
        """Per (rank, step, pg, op) sums of the collective log, for every full-resolution step
        (the per-collective detail, ``collectives()``, may hold only the recent steps)."""
        return rundir_series.collective_steps(self)

    def step_series(self):
        """Per (rank, step): timings, input wait, time blocked in collectives, memory."""
        return rundir_series.step_series(self)

    def step_blocks(self):
        """Older steps folded into blocks (min/median/max/sum per block); empty when none."""
        return rundir_series.blocks(self)

    def resolution(self) -> dict | None:
        """Which steps are kept at which resolution (None: every step in full detail)."""
        return rundir_series.resolution(self)
