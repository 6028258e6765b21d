"""A run's ranks: which have files, what each says of itself, and the world size they add up to.

RunDirRanks, a part of RunDir (trainprof/analysis/run.py): the ranks present (ranks/rank-N
folders and profiler traces), each rank's meta.json, the world size checked against the ranks
present and the files that claim it (the ranks missing, and the host each ran on), which ranks
recorded the profiler window, and the job's DeviceMesh and each rank's coordinates in it. It
uses RunDir's ``path``, ``roots``, ``bare_snapshots``, ``trace_inputs``, ``problems``,
``_cache``, ``_unreadable`` and ``_rank_roots``, and its ``launcher``, ``worker_exits``,
``stream``, ``rank_path``, ``profiler_traces`` and ``_trace_meta``.
"""

from __future__ import annotations

import collections
import math
import os

from trainprof.meshinfo import group_coords
from trainprof.rankranges import ranges
from trainprof.rundir import schema as rundir_schema
from trainprof.rundir.files import (MANIFEST, META, RANKS_DIR, RunDirError, _exists, _is_dir,
                                    _listdir, rank_dirname, read_json_or_problem)
from trainprof.rundir.worker_exits import summarize

MAX_ABSENT_FACTOR, MAX_ABSENT_EXTRA = 4, 64  # a world size is trusted up to 4 x ranks present + 64


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



class RunDirRanks:
    """The ranks of the job and the facts each rank's files hold."""

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
                raw = read_json_or_problem(p, self.problems, default={})
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
