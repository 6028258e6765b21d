"""Expand a real small run's summary.json to N ranks and time the report rendering.

    python benchmarks/synth_summary.py trainprof-demo/summary.json OUT_DIR --ranks 1024 [--straggler 773]

Every per-rank structure of the summary (lists of records with a "rank", rank-keyed dicts, rank
lists, run.ranks) is replicated: rank r copies base rank r % B (B = the base world size) with
±3 % jitter on its floats, 8 ranks per host (node000, node001, ...), the dp coordinate widened.
With --straggler R the base's straggler (the one rank its stragglers analyzer named) becomes rank
R alone and its other copies take a peer's data. Writes OUT_DIR/summary.json and report.html and
prints their sizes and the render time. For rendering at scale only: the analysis itself at N ranks
is benchmarked from synthesized run directories (benchmarks/synth_run.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
import time
from pathlib import Path

RANK_LIST_KEYS = {"ranks", "ranks_watched", "peers", "waiters", "late_ranks", "received_by",
                  "missing_ranks", "waiting_ranks"}
# keys whose dict keys are steps or group ids, not ranks
NOT_RANK_KEYED = re.compile(r"by_step|group_dims|^gantt$")


class Expander:
    def __init__(self, base_world: int, n: int, per_host: int = 8, straggler_src=None,
                 straggler=None, peer_src=None, seed: int = 0):
        self.b, self.n, self.per_host = base_world, n, per_host
        self.straggler_src, self.straggler, self.peer_src = straggler_src, straggler, peer_src
        self.rng = random.Random(seed)

    def src(self, r: int) -> int:
        s = r % self.b
        if self.straggler is not None and s == self.straggler_src and r != self.straggler:
            return self.peer_src
        return s

    def new_ranks(self, old: int) -> list[int]:
        """Every new rank that copies base rank `old` (the straggler keeps one copy)."""
        if self.straggler is not None and old == self.straggler_src:
            return [self.straggler]
        out = [r for r in range(old, self.n, self.b)]
        if self.straggler is not None and old == self.peer_src:
            out += [r for r in range(self.straggler_src, self.n, self.b) if r != self.straggler]
        return sorted(out)

    def jitter(self, v):
        if isinstance(v, float):
            return v * (1 + self.rng.uniform(-0.03, 0.03))
        if isinstance(v, list):
            return [self.jitter(x) for x in v]
        if isinstance(v, dict):
            return {k: (x if k in ("rank", "step") else self.jitter(x)) for k, x in v.items()}
        return v

    def coords(self, c, r: int):
        if not isinstance(c, dict) or "dp" not in c:
            return c
        return {**c, "dp": c["dp"] + (r // self.b) * self._dp}

    def rank_list(self, v: list) -> list:
        if not all(isinstance(x, int) and 0 <= x < self.b for x in v):
            return v
        return sorted({r for x in v for r in self.new_ranks(x)})

    def walk(self, v, key: str = ""):
        if isinstance(v, dict):
            keys = list(v)
            if (keys and not NOT_RANK_KEYED.search(key)
                    and all(k.isdigit() and int(k) < self.b for k in keys)):
                have = {int(k) for k in keys}
                return {str(r): self.jitter(copy.deepcopy(v[str(self.src(r))]))
                        for r in range(self.n) if self.src(r) in have}
            return {k: (x if NOT_RANK_KEYED.search(k) else self.walk(x, k)) for k, x in v.items()}
        if isinstance(v, list):
            if v and all(isinstance(x, dict) and isinstance(x.get("rank"), int) for x in v):
                out = []
                for r in range(self.n):
                    for x in v:
                        if x["rank"] == self.src(r):
                            y = self.jitter(copy.deepcopy(x))
                            y["rank"] = r
                            if "coords" in y:
                                y["coords"] = self.coords(y["coords"], r)
                            if "host" in y:
                                y["host"] = f"node{r // self.per_host:03d}"
                            out.append({k: (self.walk(w, k) if k != "coords" else w) for k, w in y.items()})
                return out
            if key in RANK_LIST_KEYS:
                return self.rank_list(v)
            return [self.walk(x, key) for x in v]
        return v

    def expand(self, summary: dict) -> dict:
        s = copy.deepcopy(summary)
        run = s.get("run") or {}
        mesh = run.get("mesh") or {}
        factor = self.n // self.b
        self._dp = mesh.get("dp", 1)
        if "dp" in mesh:
            mesh["dp"] *= factor
        run["world_size"] = self.n
        base = {r["rank"]: r for r in run.get("ranks") or []}
        run["ranks"] = [{**base[r % self.b], "rank": r, "host": f"node{r // self.per_host:03d}",
                         "local_rank": r % self.per_host,
                         "coords": self.coords(base[r % self.b].get("coords"), r)}
                        for r in range(self.n) if r % self.b in base]
        s["metrics"] = self.walk(s.get("metrics") or {})
        for f in s.get("findings") or []:
            f["ranks"] = self.rank_list(f.get("ranks") or [])
            f["evidence"] = self.walk(f.get("evidence") or {})
            ev = f["evidence"]
            if self.straggler is not None and ev.get("rank") == self.straggler_src:
                ev.update(rank=self.straggler, coords=self.coords(ev.get("coords"), self.straggler),
                          host=f"node{self.straggler // self.per_host:03d}")
            if self.straggler is not None and isinstance(f.get("message"), str):
                f["message"] = re.sub(rf"\brank {self.straggler_src}\b", f"rank {self.straggler}",
                                      f["message"])
        st = s["metrics"].get("stragglers")
        if isinstance(st, dict) and self.straggler is not None:
            st["chronic"] = [self.straggler]
        return s


def expand(summary: dict, n: int, straggler: int | None = None, per_host: int = 8, seed: int = 0) -> dict:
    base_world = int((summary.get("run") or {}).get("world_size") or 1)
    src = peer = None
    if straggler is not None:
        chronic = ((summary.get("metrics") or {}).get("stragglers") or {}).get("chronic") or []
        if len(chronic) != 1:
            raise SystemExit("--straggler needs a base summary with exactly one chronic straggler")
        src = chronic[0]
        groups = ((summary.get("metrics") or {}).get("stragglers") or {}).get("peer_groups") or {}
        peer = next((int(r) for r, g in groups.items() if g == groups.get(str(src)) and int(r) != src),
                    (src + 1) % base_world)
        if straggler % base_world != src:
            raise SystemExit(f"--straggler must be ≡ {src} mod {base_world} (it copies base rank {src})")
    return Expander(base_world, n, per_host, src, straggler, peer, seed).expand(summary)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--straggler", type=int, default=None)
    a = ap.parse_args(argv)
    from trainprof.reports.html import write_html
    from trainprof.reports.terminal import render_terminal

    summary = expand(json.loads(a.summary.read_text()), a.ranks, a.straggler)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(summary))
    t0, c0 = time.perf_counter(), time.process_time()
    path = write_html(summary, a.out / "report.html")
    t_html, c_html = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    render_terminal(summary, report_path=path)
    t_term = time.perf_counter() - t0
    print(f"{a.ranks} ranks: summary.json {(a.out / 'summary.json').stat().st_size / 1e6:.2f} MB, "
          f"report.html {path.stat().st_size / 1e6:.2f} MB rendered in {t_html:.2f} s "
          f"({c_html:.2f} s CPU), "
          f"terminal {t_term:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
