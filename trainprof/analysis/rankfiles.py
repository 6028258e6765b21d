"""A rank's files: its streams (one rank's records, or all ranks' as one frame), the per-step
series, hang dumps, fatal-signal stacks and allocator snapshots.

RunDirFiles, a part of RunDir (trainprof/analysis/run.py): every file of a ranks/rank-N folder
read once and shared by the analyzers through RunDir's cache — a stream's records checked
against the documented field types (trainprof/rundir/streams.py), a symbolic link out of the run
directory refused, the bounded capture's compact tables and rings read as the full format
(trainprof/rundir/series.py). It uses RunDir's ``path``, ``bare_snapshots``, ``problems``,
``_cache``, ``_unreadable`` and ``_rank_roots``, and its ``ranks`` and ``rank_path``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainprof import safeio
from trainprof.rundir import detail as rundir_detail, schema as rundir_schema, series as rundir_series, \
    streams as rundir_streams
from trainprof.rundir.files import (FATAL_STACKS, MAX_FATAL_STACKS_BYTES, NOT_SNAPSHOTS,
                                    SNAPSHOT_SUFFIXES, STEPS, _exists, _is_dir, _listdir, read_json)
from trainprof.rundir.health import outside_link
from trainprof.rundir.streams import read_records


def _rank_from_name(name: str) -> int | None:
    """rank-00003_x.pickle, rank3.pickle, snapshot_rank_3.pickle -> 3; else None."""
    m = re.search(r"rank[-_]?(\d+)", name)
    return int(m.group(1)) if m else None


class RunDirFiles:
    """Every file of a rank's folder, read once."""

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
        if name == "collectives":  # bounded capture: the newest detail (rundir/detail.py)
            if rundir_series.has_compact(self, rank):  # the ring and the detail windows
                return rundir_detail.detail_records(self, rank, read_records)
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

            df = rundir_detail.common_detail(self, df)  # rings: the steps every rank holds
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
