"""A run's profiler traces: which trace file is each rank's, and what is read of them.

RunDirTraces, a part of RunDir (trainprof/analysis/run.py): the traces of RUN/profiler/ and, where
the job ran its own profiler, the job's exported traces and the one window of each rank that is
analyzed; the parsed traces (trainprof.trace) for per-rank detail, and their digests
(trainprof/analysis/digest.py), which job-level analysis reads one trace at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainprof.rundir.files import (JOB_TRACES_DIR, META, PROFILER_DIR, RANKS_DIR, RunDirError,
                                    _is_dir, _is_file, _listdir, _same_file, _size_mtime,
                                    is_job_trace_name, job_trace_dir, rank_dirname, read_json)
from trainprof.trace import _discover as disc, load_traces
from trainprof.trace._discover import prepare_window

# what choosing among a job's windows reads of each (kept with the rank's digest)
_WINDOW_FACTS = ("path", "whole_trace_window", "span_ns", "steps", "window")


def _window_facts_ok(facts: dict) -> bool:
    """Window facts kept in a digest have the types choosing among windows reads."""
    w, span = facts.get("window"), facts.get("span_ns")
    return (isinstance(facts.get("path"), str) and isinstance(w, dict)
            and all(type(w.get(k, 0)) is int for k in ("work_steps", "events"))
            and (span is None or (isinstance(span, list) and len(span) == 2
                                  and all(type(x) is int for x in span))))


def _job_candidates(root: Path, rank: int, jp: dict, paths: list[Path],
                    linked: Path | None) -> list[tuple[Path, Path]]:
    """A rank's job traces as (path read, path said: the job's own), each file once. Each is
    read from the run directory where it holds it: ``linked`` (RUN/profiler/rank-NNNNN.*, the
    job's last trace when meta's ``linked`` names it, or the same file), else its link in
    RUN/profiler/job/rank-NNNNN/ (meta's ``links``), else the job's path; so a run directory
    copied elsewhere, or whose job folder was cleaned, reads the same windows. Files met twice
    (hard links, repeats): the last. A ``linked`` that is none of them (the job's files moved,
    meta without ``linked``) is the last, unless it is a copy of one of them (same size and
    mtime: copytree, cp -p)."""
    links = jp.get("links") if isinstance(jp.get("links"), dict) else {}
    last = paths[-1] if paths and linked is not None and jp.get("linked") == linked.name else None
    out: list[tuple[Path, Path]] = []
    for p in paths:
        options = [linked] if linked is not None and (p == last or _same_file(p, linked)) else []
        rel = links.get(str(p))
        parts = rel.split("/") if isinstance(rel, str) else []
        if (len(parts) == 3 and parts[:2] == [JOB_TRACES_DIR, rank_dirname(rank)]
                and is_job_trace_name(parts[2])):
            options.append(job_trace_dir(root, rank) / parts[2])
        read = next((q for q in options + [p] if _is_file(q)), None)
        if read is not None:
            out = [c for c in out if not _same_file(c[0], read)] + [(read, p)]
    if linked is not None and _is_file(linked) and not any(read == linked for read, _ in out):
        sig = _size_mtime(linked)
        if sig is None or all(_size_mtime(read) != sig for read, _ in out):
            out = [c for c in out if not _same_file(c[0], linked)] + [(linked, linked)]
    return out


class RunDirTraces:
    """RunDir's profiler traces (reads its ``roots``, ``trace_inputs``, ``rank_meta``,
    ``problems`` and ``_cache``)."""

    # -- profiler traces
    def profiler_traces(self) -> dict[int, Path]:
        """rank -> trace file. Ranks come from our file names; other names are read for
        distributedInfo.rank by the trace parser (see traces())."""
        if "trace_paths" not in self._cache and self.trace_inputs:
            self._load_bare_traces()
        if "trace_paths" not in self._cache:
            out: dict[int, Path] = {}
            for d in [root / PROFILER_DIR for root in self.roots]:
                if not _is_dir(d):
                    continue
                for p in _listdir(d, self.problems):
                    if not p.name.endswith((".json", ".json.gz")):
                        continue
                    if p.name.startswith("rank-"):
                        try:
                            r = int(p.name[5:10])
                        except ValueError:
                            r = None
                        if r is not None and r in out and out[r].parent != p.parent:
                            raise RunDirError(f"rank {r} has a trace in two run directories: "
                                              f"{out[r]} and {p}; analyze together only run "
                                              f"directories holding different ranks")
                        if r is not None:
                            out[r] = p
                            continue
                    self.problems.append(f"{p}: trace file not named rank-NNNNN.*, ignored")
            self._job_traces(out)
            self._cache["trace_paths"] = out
        return self._cache["trace_paths"]

    def _job_traces(self, out: dict[int, Path]) -> None:
        """Ranks whose job ran its own profiler (meta.json ``job_profiler``): where trainprof
        has no trace of its own, the job's exported traces stand in (read from their links in
        RUN/profiler/ where the run directory holds them, else where the job wrote them: those
        still there, _job_candidates); said in problems. Of several, the window that holds the
        most training is analyzed, chosen as among bare traces (_choose_job_windows)."""
        said: dict[str, list[int]] = {}
        several: dict[int, list[tuple[Path, Path]]] = {}
        self._cache["job_windows"] = {}
        for m in sorted(m for root in self.roots for m in (root / RANKS_DIR).glob(f"rank-*/{META}")):
            try:
                r = int(m.parent.name[5:])
            except ValueError:
                continue
            jp = self.rank_meta(r).get("job_profiler")
            if not isinstance(jp, dict) or (r in out and not jp.get("window_skipped")):
                continue
            paths = [Path(p) for p in jp.get("traces") or []
                     if isinstance(p, str) and p.endswith((".json", ".json.gz"))]
            # (path read, path said): the copies the run directory holds read first
            cands = _job_candidates(m.parent.parent.parent, r, jp, paths, out.get(r))
            if cands:
                out[r] = cands[-1][0]
                self._cache["job_windows"][r] = []
            if len(cands) > 1:
                several[r] = cands
            where = (f"its traces are at {paths[-1].parent}" + ("" if r in out else " (not found: "
                     "no profiler analysis)") if paths else "it exported no trace: no profiler analysis")
            skipped = "trainprof's window skipped; " if jp.get("window_skipped") else ""
            said.setdefault(f"job runs its own profiler: {skipped}{where}", []).append(r)
        for msg, ranks in said.items():
            self.problems.append(f"{msg} (ranks {', '.join(map(str, ranks[:8]))}"
                                 f"{', …' if len(ranks) > 8 else ''})")
        if several:
            self._choose_job_windows(out, several)

    def _choose_job_windows(self, out: dict[int, Path], several: dict) -> None:
        """Ranks with several of the job's traces (torch writes one per cycle of a schedule, and
        a last, cut off one when the profiler stops before its cycle ends): the window that
        holds the most training is analyzed (trainprof/trace/_discover.py choose_window, its
        trailing stub steps dropped), a problem line naming those left out. What each window
        holds is read from the rank's digest when it lists those very files (same path, size
        and mtime), else parsed (in the digest pool, no analyzer run) and kept with the digest
        (trainprof/analysis/digest.py ensure)."""
        from trainprof.analysis import digest  # lazy: breaks a cycle analysis.traces<->analysis.digest

        known: dict[tuple[int, Path], dict] = {}
        stamps: dict[tuple[int, Path], dict] = {}
        todo = []
        for r, cands in sorted(several.items()):
            root = digest.digest_root(self, r, out[r])
            cached = self._cached_windows(digest.digest_path(root, r))
            for p, _ in cands:
                try:
                    stamp = digest.trace_stamp(root, p)
                except OSError:
                    continue
                stamps[r, p] = stamp
                hit = next((w for w in cached if w["trace"] == stamp), None)
                if hit is not None:
                    known[r, p] = hit["facts"]
                else:
                    todo.append(("window", None, r, str(p), stamp, None, [], 1))
        for (key, doc, err), job in zip(digest.run_jobs(todo), todo):
            if err:
                self.problems.append(err)
            else:
                known[job[2], Path(key)] = {k: doc["facts"][k] for k in _WINDOW_FACTS
                                            if k in doc["facts"]}
        for r, cands in sorted(several.items()):
            heads, link = [], {}
            for p, shown in cands:
                facts = known.get((r, p))
                if facts is None:
                    continue
                # named as the job named it (the trace linked into RUN/profiler/ too)
                heads.append(digest.TraceHead({"rank": r, "facts": {**facts, "path": str(shown)}}))
                link[shown] = p
            if not heads:
                continue
            best = disc.choose_window(f"rank {r}", heads, self.problems)
            out[r] = link[best.path]
            self._cache["job_windows"][r] = [
                {"trace": stamps[r, p], "facts": known[r, p]} for p, _ in cands if (r, p) in known]

    def _cached_windows(self, path: Path) -> list[dict]:
        """The windows a rank's cached digest lists (``windows``: what each of the job's traces
        holds), when the digest is of this code; [] otherwise."""
        from trainprof.analysis import digest  # lazy: breaks a cycle analysis.traces<->analysis.digest

        try:
            os.stat(path)
            doc = read_json(path)
        except (OSError, RunDirError):
            return []
        if not isinstance(doc, dict) or doc.get("code") != digest.code_fingerprint():
            return []
        ws = doc.get("windows")
        if not isinstance(ws, list):
            return []
        return [w for w in ws if isinstance(w, dict) and isinstance(w.get("trace"), dict)
                and isinstance(w.get("facts"), dict) and _window_facts_ok(w["facts"])]

    def job_windows(self) -> dict[int, list[dict]]:
        """Ranks whose trace the job's own profiler wrote -> what each of its windows holds
        ([{"trace": stamp, "facts": ...}]; [] when there was one window only)."""
        self.profiler_traces()
        return self._cache.get("job_windows", {})

    def traces(self, progress=None) -> dict:
        """rank -> parsed trace (trainprof.trace.Trace), parsed once, in parallel across ranks.
        Every trace stays in memory: for per-rank detail only. Job-level analysis reads
        trace_digests(), which needs one trace in memory at a time."""
        paths = self.profiler_traces()
        if "traces" not in self._cache:
            traces, errors = load_traces(paths, progress=progress)
            self.problems.extend(errors)

            if self.trace_inputs:  # a bare trace is the rank its discovery gave it
                for r, t in traces.items():
                    t.rank = r
                    prepare_window(t)  # stub steps dropped as in its digest (said there)
            else:
                for r in self.job_windows():  # the job's own traces: as bare traces
                    if r in traces:
                        prepare_window(traces[r])
            self._cache["traces"] = traces
        self._say_trace_facts([(r, t.path, t.stats.get("gpu_ops_without_launch"),
                                t.meta.get("whole_trace_window"), t.meta.get("span_ns"))
                               for r, t in sorted(self._cache["traces"].items())])
        return self._cache["traces"]

    def _say_trace_facts(self, facts: list[tuple]) -> None:
        """Problems about how the traces were read, once: (rank, path, GPU ops without a launch,
        whole-trace window, span) of each (from the parsed traces or from their digests)."""
        if "traces_said" in self._cache:
            return
        self._cache["traces_said"] = True
        for r, path, n, whole, span in facts:
            if n:
                self.problems.append(
                    f"{path}: {n} GPU op(s) have no launching runtime call in the trace "
                    f"(queued before recording started): left out of the step windows")
            if whole:
                span = span or [0, 0]
                self.problems.append(
                    f"{path}: no ProfilerStep in the trace (torch.profiler used without "
                    f"schedule/step()): rank {r} analyzed as one window covering the whole "
                    f"trace ({(span[1] - span[0]) / 1e6:.3f} ms), not per step")

    def trace_digests(self, name: str) -> dict[int, dict]:
        """rank -> the per-rank digest section ``name`` of that rank's profiler trace: what the
        analyzer ``name`` computes from one trace alone (its module's ``trace_digest(run, rank,
        trace) -> dict``, small and JSON-able). Job-level analysis reads these, never the traces
        themselves, so that it needs one trace in memory at a time (digest_docs). A rank whose
        section failed is left out, with a problem; when it failed on every rank, RunDirError."""
        key = ("digest", name)
        if key not in self._cache:
            out, failed = {}, []
            for r, doc in self.digest_docs(extra=name).items():
                sec = doc["sections"].get(name) or {}
                if isinstance(sec.get("data"), dict):
                    out[r] = sec["data"]
                else:
                    failed.append((r, sec.get("error") or "not computed"))
            if failed:
                shown = ", ".join(str(r) for r, _ in failed[:8]) + (", …" if len(failed) > 8 else "")
                self.problems.append(f"{name}: the reduction of the profiler trace failed on rank(s) "
                                     f"{shown} ({failed[0][1]}); left out of its figures")
                if not out:
                    raise RunDirError(f"{name}: trace_digest failed on every rank: {failed[0][1]}")
            self._cache[key] = out
        return self._cache[key]

    def digest_docs(self, progress=None, extra: str | None = None,
                    write: bool = False) -> dict[int, dict]:
        """rank -> the whole digest of its profiler trace (trainprof/analysis/digest.py): read from
        RUN/digests/ when current, else built in a process pool, one trace per worker at a
        time, and (``write``: what `trainprof analyze` does when its outputs go into the run
        directory) cached there; bare trace inputs are never written beside.
        ``extra``: an analyzer whose section is wanted besides ANALYZER_MODULES' ones."""
        from trainprof.analysis import digest  # lazy: breaks a cycle analysis.traces<->analysis.digest

        self.profiler_traces()  # bare traces are digested while their ranks are found
        names = digest.section_names()
        if extra and extra not in names:
            names.append(extra)
        docs = self._cache.get("digest_docs")
        if docs is None or any(n not in d["sections"] for d in docs.values() for n in names):
            docs, _ = digest.ensure(self, names, progress=progress, write=write)
            self._cache["digest_docs"] = docs
        self._say_trace_facts([(r, d["facts"]["path"], d["facts"].get("gpu_ops_without_launch"),
                                d["facts"].get("whole_trace_window"), d["facts"].get("span_ns"))
                               for r, d in sorted(docs.items())])
        return docs
