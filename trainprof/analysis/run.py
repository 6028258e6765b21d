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
traces means digesting them (trainprof/analysis/digest.py runs analyzers over each trace). Its
parts: what an input is and bare profiler traces read as a run (inputs.py), the launcher's facts
(manifest.py), the ranks and the world size they add up to (ranks.py), each rank's files and
streams (rankfiles.py) and a run's profiler traces (traces.py). Readers tolerate a torn last line and report every other defect with the file it came
from; they read only regular files within the input limits (trainprof/safeio.py), check every
record against the documented field types, check the world size against the ranks present, and
refuse a run directory of a newer schema (SchemaVersionError).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainprof.rundir.files import (
    FATAL_STACKS, INJECTED, JOB_TRACES_DIR, MANIFEST, MAX_FATAL_STACKS_BYTES, MAX_WORKER_EXITS_BYTES,
    NOT_SNAPSHOTS, SNAPSHOT_SUFFIXES, TRACE_SUFFIXES, MAX_PROBLEMS_PER_FILE, META, PROFILER_DIR, RANKS_DIR,
    REPORT, SCHEMA_VERSION, STEPS, SUMMARY, JsonlWriter, RunDirError, SchemaVersionError, _exists,
    _is_dir, close_quietly, collect_rank_entries, dumps_compact, is_job_trace_name,
    iter_jsonl, job_trace_dir, profiler_trace_path, rank_dir, rank_dirname, read_json,
    write_json_atomic)
from trainprof.analysis.inputs import RunDirInputs
from trainprof.analysis.manifest import RunDirManifest
from trainprof.analysis.rankfiles import RunDirFiles
from trainprof.analysis.ranks import MAX_ABSENT_EXTRA, MAX_ABSENT_FACTOR, RunDirRanks
from trainprof.analysis.traces import RunDirTraces

__all__ = [
    "FATAL_STACKS", "INJECTED", "JOB_TRACES_DIR", "MANIFEST", "MAX_ABSENT_EXTRA",
    "MAX_ABSENT_FACTOR", "MAX_FATAL_STACKS_BYTES", "MAX_PROBLEMS_PER_FILE",
    "MAX_WORKER_EXITS_BYTES", "META", "NOT_SNAPSHOTS", "PROFILER_DIR", "RANKS_DIR", "REPORT",
    "SCHEMA_VERSION", "SNAPSHOT_SUFFIXES", "STEPS", "SUMMARY", "TRACE_SUFFIXES", "JsonlWriter",
    "RunDir", "RunDirError", "SchemaVersionError", "close_quietly", "collect_rank_entries",
    "dumps_compact", "is_job_trace_name", "iter_jsonl", "job_trace_dir", "profiler_trace_path",
    "rank_dir", "rank_dirname", "read_json", "write_json_atomic"]


class RunDir(RunDirInputs, RunDirManifest, RunDirRanks, RunDirFiles, RunDirTraces):
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
