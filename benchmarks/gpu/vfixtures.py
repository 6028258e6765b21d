"""Fixtures from a validation run, for CPU CI: small run directories and traces, and the check
each one must pass again when re-analysed on a machine without a GPU.

DIR/fixtures.json: {"versions": {...}, "cuda": bool, "fixtures": [{"check", "path", "source",
"number", "kwargs"}]}; DIR/<source>/ a run directory (report.html, summary.json and the digest
cache left out: CI re-analyses), DIR/<source>.pt.trace.json.gz a trace. Only checks that passed
give fixtures. verify(DIR) copies each run directory to a temporary folder, runs `trainprof
analyze` there on CPU and applies the check's evaluator (veval) again with the fixture's cuda flag:
tests/unit/trainprof/test_gpu_validated_fixtures.py does this on tests/fixtures/gpu/validated/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import veval
from vcore import Result, Verdict

MAX_FILE_MB = 2.0    # every trace and snapshot
MAX_TOTAL_MB = 12.0  # all fixtures of one run (they travel back as one tarball)
LEAVE_OUT = {"report.html", "summary.json", "digests"}
NAME = "fixtures"


def _ignore(_dir, names):
    return [n for n in names if n in LEAVE_OUT or n.endswith(".tmp")]


def _prepare(dest: Path) -> None:
    """An empty dest: refuse to empty a folder this module did not write."""
    if dest.exists() and any(dest.iterdir()):
        if not (dest / "fixtures.json").is_file():
            raise RuntimeError(f"{dest} is not empty and holds no fixtures.json: not replaced")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def collect(results: dict, dest: Path) -> list[dict]:
    """Copy the passing checks' runs and traces into dest: the fixtures.json entries."""
    entries, copied = [], {}
    for r in results.values():
        fx = r.data.get("fixture")
        if not fx or not r.ok:
            continue
        e = {"check": fx["check"], "number": r.number, "kwargs": fx.get("kwargs", {})}
        if fx.get("trace"):
            src = Path(r.data["trace"])
            e["path"] = f"{r.name}.pt.trace.json.gz"
            shutil.copyfile(src, dest / e["path"])
        else:
            source = fx.get("of") or r.name
            run = Path(results[source].data["run"]) if source in results else None
            if run is None or not run.is_dir():
                continue
            if source not in copied:
                shutil.copytree(run, dest / source, ignore=_ignore)
                copied[source] = True
            e["path"] = source
        entries.append(e)
    return entries


def sizes(dest: Path) -> tuple[float, float, str]:
    """(total MB, largest trace/snapshot MB, its name)."""
    total, big, name = 0, 0, ""
    for p in dest.rglob("*"):
        if p.is_file():
            total += p.stat().st_size
            if p.name.endswith((".json.gz", ".json", ".pickle")) and p.stat().st_size > big and \
                    p.name not in ("meta.json", "manifest.json", "fixtures.json"):
                big, name = p.stat().st_size, str(p.relative_to(dest))
    return total / 2**20, big / 2**20, name


def write(ctx, results: dict, dest: Path, versions: dict) -> Result:
    t0, v = time.monotonic(), Verdict()
    try:
        _prepare(dest)
        entries = collect(results, dest)
        (dest / "fixtures.json").write_text(json.dumps(
            {"versions": versions, "cuda": ctx.cuda, "fixtures": entries}, indent=1) + "\n")
        total, big, name = sizes(dest)
        v.need(f"largest trace/snapshot <= {MAX_FILE_MB} MB (got {big:.2f} MB: {name})", big <= MAX_FILE_MB)
        v.need(f"all fixtures <= {MAX_TOTAL_MB} MB (got {total:.1f} MB)", total <= MAX_TOTAL_MB)
        want = sum(1 for r in results.values() if r.ok and r.data.get("fixture"))
        v.need(f"a fixture from every passing check that makes one ({len(entries)} of {want})",
               len(entries) == want)
        for e, ver in verify(dest, ctx.work):
            v.need(f"{e['check']} ({e['path']}) re-analysed on CPU: "
                   + ("holds" if ver.ok else "; ".join(ver.failed())), ver.ok)
        v.number = f"{len(entries)} fixtures, {total:.1f} MB (max {big:.2f} MB)"
    except Exception as e:  # noqa: BLE001 - reported as this check's failure
        v.need(f"{type(e).__name__}: {e}", False)
    return Result(name=NAME, ok=v.ok, number=v.number or "-",
                  detail="; ".join(v.failed()) or f"written to {dest}, re-analysed on CPU",
                  seconds=time.monotonic() - t0, criteria=v.criteria)


def _analyze(run: Path) -> dict | None:
    env = {k: x for k, x in os.environ.items() if not k.startswith("TRAINPROF_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as CPU CI
    r = subprocess.run([sys.executable, "-m", "trainprof", "analyze", str(run), "--no-report", "--quiet"],
                       env=env, capture_output=True, text=True, timeout=300)
    p = run / "summary.json"
    return json.loads(p.read_text()) if r.returncode == 0 and p.is_file() else None


def verify(src: Path, scratch: Path | None = None) -> list[tuple[dict, Verdict]]:
    """Each fixture of src (fixtures.json) re-analysed on CPU (in a copy under scratch, default
    the system's temporary folder) and checked again."""
    doc = json.loads((src / "fixtures.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="fixtures-", dir=scratch))
    runs = sorted({e["path"] for e in doc["fixtures"] if (src / e["path"]).is_dir()})
    for name in runs:
        shutil.copytree(src / name, tmp / name)
    with ThreadPoolExecutor(max_workers=min(4, len(runs) or 1)) as pool:
        summaries = dict(zip(runs, pool.map(lambda n: _analyze(tmp / n), runs)))
    out = []
    for e in doc["fixtures"]:
        v = Verdict()
        try:
            if e["path"] in summaries:
                s = summaries[e["path"]]
                if v.need("trainprof analyze on CPU", s is not None):
                    veval.EVALUATORS[e["check"]](v, tmp / e["path"], s, doc["cuda"], **e["kwargs"])
            else:
                veval.TRACE_EVALUATORS[e["check"]](v, src / e["path"], doc["cuda"], **e["kwargs"])
        except Exception as exc:  # noqa: BLE001 - this fixture fails, the others are checked
            v.need(f"{type(exc).__name__}: {exc}", False)
        out.append((e, v))
    shutil.rmtree(tmp, ignore_errors=True)
    return out
