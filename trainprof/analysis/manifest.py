"""A run's launcher facts: manifest.json, the node records and how the workers ended.

RunDirManifest, a part of RunDir (trainprof/analysis/run.py): the launcher's manifest.json (a
newer schema refused), the launcher records of every node merged over it (several nodes, or
several run directories of one job: trainprof/rundir/nodes.py), and the torchrun agents' record
of how each worker ended (worker-exits.jsonl). It uses RunDir's ``path``, ``roots``,
``bare_snapshots``, ``trace_inputs``, ``problems`` and ``_cache``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainprof.rundir import schema as rundir_schema
from trainprof.rundir.files import (MANIFEST, MAX_WORKER_EXITS_BYTES, SCHEMA_VERSION, SchemaVersionError,
                                    _exists, iter_jsonl, read_json_or_problem)
from trainprof.rundir.worker_exits import STREAM


class RunDirManifest:
    """What the launcher (`trainprof wrap`) and the torchrun agents recorded of the job."""

    @property
    def launcher(self) -> dict:
        """manifest.json as the launcher wrote it ({} when missing, e.g. a probe-only run), its
        wrongly typed fields dropped (each a problem). A newer schema_version, or one that is not
        a version number, raises SchemaVersionError."""
        if "launcher" not in self._cache:
            p = self.path / MANIFEST
            man: dict = {}
            if not self.bare_snapshots and not self.trace_inputs and _exists(p, self.problems):
                raw = read_json_or_problem(p, self.problems, default={})
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
        raw = read_json_or_problem(p, self.problems, default={})
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
