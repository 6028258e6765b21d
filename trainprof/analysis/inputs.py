"""What an input of `trainprof analyze` is, and bare torch.profiler traces read as a run.

RunDirInputs, a part of RunDir (trainprof/analysis/run.py): an input path classified (a run
directory, a profiler trace file or a folder of them, allocator snapshots, several run
directories of one job, several trace inputs analyzed as one job), the traces below a folder
that holds none itself, and bare traces digested, grouped into one job, their windows chosen
and their ranks found (trainprof/trace/_discover.py), with the rank and run facts only a trace
carries.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainprof.rundir import schema as rundir_schema
from trainprof import safeio
from trainprof.rundir.files import (MANIFEST, PROFILER_DIR, RANKS_DIR, SNAPSHOT_SUFFIXES, TRACE_SUFFIXES,
                                    RunDirError, _exists,
                                    _is_dir, _listdir, read_json)
from trainprof.trace._discover import (SEARCH_DEPTH, is_trace_name, rank_facts, run_facts,
                                       trace_folders)
from trainprof.trace import _discover as disc



def _below(sub: Path, root: Path) -> str:
    """``sub`` as a path under ``root`` ("lightning_logs/version_0/"), else as it is."""
    try:
        return f"{Path(sub).relative_to(root)}/"
    except ValueError:
        return str(sub)


def _distinct_steps(heads) -> int:
    """How many distinct steps (ProfilerStep numbers) the traces of ``heads`` profiled, each
    step once whatever the number of ranks that hold it; a trace whose step numbers its digest
    does not list counts its own number of steps."""
    nums: set = set()
    counted = 0
    for h in heads:
        steps = (h.doc.get("facts", {}).get("window") or {}).get("steps")
        if isinstance(steps, list):
            nums.update(s for s in steps if isinstance(s, int))
        else:
            counted = max(counted, h.steps)
    return max(len(nums), counted)


class RunDirInputs:
    """RunDir's reading of what it was given (its ``path``, ``trace_inputs``,
    ``bare_snapshots``, ``roots``, ``input_facts``, ``problems`` and ``_cache``)."""

    def _classify(self, path: Path) -> None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise RunDirError(f"{path}: no such directory") from None
        except OSError as e:
            raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from None
        if stat.S_ISREG(mode):
            if not is_trace_name(path.name) and path.name.endswith(TRACE_SUFFIXES):
                raise RunDirError(f"{path}: a run-directory document, not a profiler trace; "
                                  f"analyze the folder it belongs to")
            if path.name.endswith(TRACE_SUFFIXES):
                self._bare_trace_inputs([path])
                return
            if not path.name.endswith(SNAPSHOT_SUFFIXES):
                raise RunDirError(f"{path}: not a directory (nor a profiler trace *.json[.gz] "
                                  f"nor an allocator snapshot *.pickle written by "
                                  f"torch.cuda.memory._dump_snapshot)")
            self.bare_snapshots = [path]
            self.path = path.parent
        elif not stat.S_ISDIR(mode):
            raise RunDirError(f"{path}: not a directory nor a regular file; not read")
        elif not _exists(path / MANIFEST) and not _is_dir(path / RANKS_DIR) \
                and _is_dir(path / PROFILER_DIR):
            # only profiler/: traces copied into the run-directory layout, named any way
            self._bare_trace_inputs([path / PROFILER_DIR])
            self.path = path
        elif not _exists(path / MANIFEST) and not _is_dir(path / RANKS_DIR):
            listed: list[str] = []
            entries = _listdir(path, listed)
            if listed:
                raise RunDirError(listed[0])
            if any(is_trace_name(p.name) and safeio.is_regular(p) for p in entries):
                self._bare_trace_inputs([path])
                snaps = [p for p in entries if p.name.endswith(SNAPSHOT_SUFFIXES)]
                if snaps:
                    self.problems.append(f"{path}: {len(snaps)} allocator snapshot(s) beside the "
                                         f"traces are not analyzed with them; analyze them one by "
                                         f"one (trainprof analyze {snaps[0]})")
                return
            self.bare_snapshots = [p for p in entries
                                   if p.name.endswith(SNAPSHOT_SUFFIXES) and safeio.is_regular(p)]
            if not self.bare_snapshots:
                self._traces_below(path)

    def _traces_below(self, path: Path) -> None:
        """A folder holding nothing trainprof reads: the traces in its subfolders (a bounded
        search, trainprof/trace/_discover.py trace_folders). One folder of them: analyzed, the
        outputs in ``path``, said in a problem line; several: refused, naming them; none:
        refused."""
        found, cut = trace_folders(path)
        if len(found) == 1:
            self._bare_trace_inputs(found)
            self.path = path
            self.problems.append(
                f"{path}: no profiler trace in the folder itself; analyzed the traces in "
                f"{_below(found[0], path)}, the only subfolder (down to {SEARCH_DEPTH} levels) "
                f"that holds any")
            return
        if found:
            shown = ", ".join(_below(f, path) for f in found[:6]) + (", …" if len(found) > 6 else "")
            raise RunDirError(
                f"{path}: no profiler trace in the folder itself; traces found in {len(found)} "
                f"subfolders: {shown}; analyze one at a time (trainprof analyze {found[-1]}), or "
                f"name the ones of one job together")
        searched = (f"nor in its subfolders (down to {SEARCH_DEPTH} levels"
                    f"{'; the search stopped at its bound' if cut else ''})")
        raise RunDirError(
            f"{path}: not a trainprof run directory (no {MANIFEST}, {RANKS_DIR}/ or "
            f"{PROFILER_DIR}/), no profiler traces (*.json, *.json.gz) {searched} and no "
            f"allocator snapshots (*.pickle); create one with `trainprof wrap --out {path} -- CMD`")

    def _several_run_dirs(self, dirs: list[Path]) -> None:
        """Run directories of one job, each holding some of its ranks (one per node): refused
        when they are the same directory twice, or name different jobs (manifest.json
        ``job_id``) or world sizes; ranks found in two of them are refused in ``ranks``."""
        seen: dict[str, Path] = {}
        for d in dirs:
            key = os.path.realpath(d)
            if key in seen:
                raise RunDirError(f"{d}: given twice (also as {seen[key]})")
            seen[key] = d
        self.roots = list(dirs)
        jobs: dict[str, list[str]] = {}
        worlds: dict[int, list[str]] = {}
        for d in dirs:
            p = d / MANIFEST
            try:
                man = read_json(p) if _exists(p) else {}
            except RunDirError:
                man = {}
            if not isinstance(man, dict):
                continue
            if isinstance(man.get("job_id"), str):
                jobs.setdefault(man["job_id"], []).append(str(p))
            if type(man.get("world_size")) is int:
                worlds.setdefault(man["world_size"], []).append(str(p))
        for what, claims in (("jobs", jobs), ("world sizes", worlds)):
            if len(claims) > 1:
                said = "; ".join(f"{', '.join(files)}: {v!r}" for v, files in claims.items())
                raise RunDirError(f"these run directories are of different {what} ({said}); "
                                  f"analyze together only the directories of one job")

    def _bare_trace_inputs(self, inputs: list[Path]) -> None:
        for p in inputs:
            try:
                mode = os.stat(p).st_mode
            except OSError as e:
                raise RunDirError(f"{p}: cannot read: {e.strerror or e}") from None
            if stat.S_ISDIR(mode) and (_exists(p / MANIFEST) or _is_dir(p / RANKS_DIR)):
                raise RunDirError(f"{p}: a trainprof run directory cannot be analyzed together "
                                  f"with other inputs; analyze it alone")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise RunDirError(f"{p}: not a directory nor a regular file; not read")
        self.trace_inputs = inputs
        dirs = [p if p.is_dir() else p.parent for p in inputs]
        self.path = dirs[0] if len(set(dirs)) == 1 else Path(os.path.commonpath(
            [os.path.abspath(d) for d in dirs]))

    # -- bare profiler traces (no run directory)
    def _load_bare_traces(self) -> None:
        """Digest every trace among the inputs (in a process pool, one trace per worker at a
        time, nothing written), keep one job and the window of each of its processes that holds
        the most training, and key them by rank (trainprof/trace/_discover.py); what was found
        and read goes to ``input_facts``. JSON files that are not traces are said once; inputs
        with no trace at all, or traces of several jobs given as several inputs, are refused."""
        from trainprof.analysis import digest  # lazy: breaks a cycle analysis.inputs<->analysis.digest

        files = disc.candidates(self.trace_inputs, self.problems)
        failed: dict[Path, str] = {}
        docs, _ = digest.bare_digests(files, failed=failed)
        not_traces = [p for p, err in failed.items()
                      if "not a Chrome trace" in err and disc.lacks_trace_events(p)]
        skip = set(not_traces)  # a set: 10,000 such files checked against a list took 51 s
        self.problems.extend(err for p, err in failed.items() if p not in skip)
        if not_traces:
            shown = ", ".join(p.name for p in not_traces[:6]) + (", …" if len(not_traces) > 6 else "")
            if len(not_traces) == len(files):
                raise RunDirError(self._no_trace(not_traces, shown))
            self.problems.append(f"{len(not_traces)} JSON file(s) are not profiler traces (no "
                                 f"traceEvents), not analyzed: {shown}")
        heads = [digest.TraceHead(docs[p]) for p in files if p in docs]
        other_jobs: list[Path] = []
        jobs = disc.group_jobs(heads)
        if len(jobs) > 1:
            said = "; ".join(f"job {i + 1} ({j.describe(jobs[0] if i else None, 'job 1', paths=True)})"
                             for i, j in enumerate(jobs[:4])) + ("; …" if len(jobs) > 4 else "")
            if len(self.trace_inputs) > 1:
                raise RunDirError(
                    f"these traces are of {len(jobs)} different jobs (time spans that do not "
                    f"overlap, or distributedInfo that differs): {said}; analyze the traces of "
                    f"one job at a time")
            job = disc.pick_job(jobs)
            for j in jobs:
                if j is not job:
                    other_jobs += [h.path for h in j.heads]
                    self.problems.append(
                        f"{self.trace_inputs[0]}: traces of another job left out "
                        f"({j.describe(job)}); analyzed: the latest "
                        f"{'complete ' if job.complete else ''}job ({job.describe()})")
            heads = job.heads
        heads, skipped = disc.choose_windows(heads, self.problems)
        ranked = disc.assign_ranks([(h.path, h) for h in heads], self.problems)
        # a trace digested before its rank was known (or as another rank): once more as its rank
        redo = {h.path: r for r, h in ranked.items() if h.doc.get("rank") != r}
        if redo:
            again, errors = digest.bare_digests(list(redo), ranks=redo)
            self.problems.extend(errors)
            ranked = {r: digest.TraceHead(again[h.path]) if h.path in again else h
                      for r, h in ranked.items() if h.path not in redo or h.path in again}
        for h in ranked.values():
            self.problems.extend(h.doc.get("problems") or [])
        self._cache["trace_heads"] = ranked
        self._cache["trace_paths"] = {r: h.path for r, h in ranked.items()}
        self._cache["digest_docs"] = {r: h.doc for r, h in ranked.items()}
        whole = sum(1 for h in ranked.values() if h.meta.get("whole_trace_window"))
        stubs = sum(len((h.doc["facts"].get("window") or {}).get("stub_steps") or [])
                    for h in ranked.values())
        self.input_facts = {
            "kind": "profiler traces", "inputs": [str(p) for p in self.trace_inputs],
            "files": len(files) - len(not_traces), "older_windows_skipped": skipped["older"],
            "traces_read": len(docs), "unreadable": len(files) - len(not_traces) - len(docs),
            "ranks": len(ranked), "steps": _distinct_steps(ranked.values()),
            "rank_steps": sum(h.steps for h in ranked.values()),
            **({"later_windows_skipped": skipped["later"]} if skipped["later"] else {}),
            **({"other_job_files": len(other_jobs)} if other_jobs else {}),
            **({"not_traces": len(not_traces)} if not_traces else {}),
            **({"stub_steps_dropped": stubs} if stubs else {}),
            **({"whole_trace_windows": whole} if whole else {})}

    def _no_trace(self, not_traces: list[Path], shown: str) -> str:
        """Why inputs whose every JSON file is something else than a trace are refused."""
        where = ", ".join(str(p) for p in self.trace_inputs[:3]) + \
            (" …" if len(self.trace_inputs) > 3 else "")
        msg = (f"{where}: no profiler trace: {shown} {'is' if len(not_traces) == 1 else 'are'} "
               f"JSON but not a Chrome trace (no traceEvents); expected traces written by "
               f"torch.profiler (tensorboard_trace_handler or export_chrome_trace)")
        if len(self.trace_inputs) == 1 and _is_dir(self.trace_inputs[0]):
            found, _ = trace_folders(self.trace_inputs[0])
            if found:
                msg += (f"; traces found in {', '.join(_below(f, self.trace_inputs[0]) for f in found[:6])}"
                        f": run trainprof analyze {found[0]}")
        return msg

    def _trace_heads(self) -> dict:
        """rank -> the facts of its trace (trainprof.analysis.digest.TraceHead), without parsing it."""
        if self.trace_inputs:
            self.profiler_traces()
            return self._cache.get("trace_heads", {})
        # lazy: breaks a cycle analysis.inputs<->analysis.digest
        from trainprof.analysis.digest import TraceHead

        return {r: TraceHead(d) for r, d in self.digest_docs().items()}

    def _trace_meta(self, rank: int) -> dict:
        """A rank's facts from its bare trace (distributedInfo, deviceProperties, torch's
        <host>_<pid> file name), checked like meta.json."""
        head = self._trace_heads().get(rank)
        if head is None:
            return {}
        return rundir_schema.clean_object(rundir_schema.META, rank_facts(head, rank),
                                          str(head.path), self.problems)

    def trace_run_facts(self) -> dict:
        """Run facts only a trace carries (bare traces): the process groups (pg_config) and the
        devices (deviceProperties) of the first rank that has them."""
        heads = self._trace_heads()
        return run_facts([heads[r] for r in self.ranks if r in heads])
