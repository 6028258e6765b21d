"""Detail windows: the per-collective detail of the steps around an anomaly, kept after the ring
(probes/compact.py) has moved on.

The ring holds the recent steps only. When this rank sees an anomaly, the collective log's
records of the WINDOW_STEPS steps before it and after it are also written to a file of their
own, ``compact/collectives.window-<first step>.jsonl`` (trainprof/rundir/compact.py), which the
analysis reads as detail for those steps. Anomalies, judged in-rank from the step records
(:class:`StepWatch`, on the probes' flushing thread) and the NaN watch:

* ``slow_step``: a step longer than the median of the baseline (the LONG steps before the last
  SHORT) by at least SLOW_MIN_MS, (SLOW_FACTOR − 1) × the median and 4 × (its 90th percentile −
  its median): far out of the recent range (a slow-step burst opens one window; one inside an
  open window extends it);
* ``step_time_jump``: the median of the last SHORT steps ≥ JUMP_FACTOR × the baseline's median,
  ≥ JUMP_MIN_MS more, and above the baseline's 90th percentile — this rank's step time jumped to
  a new level (a straggler's onset: its own, or its peers' wait for it); the window starts
  WINDOW_STEPS before the first step of the new level; judged again once the level is back or
  has become the baseline;
* ``nan``: the NaN watch's first detection (a ``nonfinite`` or ``origin`` record) of a step.

Bounded: at most MAX_WINDOWS windows of at most the budget's WINDOWS_SHARE / MAX_WINDOWS bytes
each (a window cut there is marked ``truncated``); a new window past MAX_WINDOWS deletes the
oldest one that is not the first of its kind: the window holding the first anomaly of each kind
(a straggler's onset, the first NaN) is kept whatever comes after it (``onset: true``; at most
one per kind, fewer than MAX_WINDOWS), so later noise cannot push it out. ``dropped`` counts
the windows deleted, ``dropped_by_kind`` by the kind of their first anomaly. ``compact/state.json`` lists the windows (the compact
store writes it on every change). Nothing here raises into the job: the store catches.

Nothing is kept in memory and nothing serialized twice: a window's steps before its anomaly are
read back from the ring's files when it opens, and while it is open each flush of the log hands
over the bytes it just wrote (whole lines, with the steps of their first and last record).
Without an open window a flush costs one attribute test.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import re
import threading

from trainprof.rundir import compact as fmt

WINDOW_STEPS = 8      # steps of detail kept before and after an anomaly
MAX_WINDOWS = 8       # windows kept per rank (the oldest deleted past it)
MIN_HISTORY = 16      # steps seen before any step-time anomaly is judged
LONG, SHORT = 64, 8   # baseline and recent steps of the step-time judgments
SLOW_FACTOR, SLOW_MIN_MS = 3.0, 5.0
JUMP_FACTOR, JUMP_MIN_MS = 1.4, 2.0
NAN_KINDS = ("nonfinite", "origin")


class StepWatch:
    """In-rank anomaly judgments over this rank's step durations (fed per steps-table row).
    The baseline (the LONG steps before the last SHORT) is kept sorted: its median and 90th
    percentile are read by index, a step costs two bisections and a sort of SHORT values."""

    def __init__(self, on_anomaly):
        self.on_anomaly = on_anomaly
        self.durs: collections.deque = collections.deque(maxlen=LONG + SHORT)
        self.steps: collections.deque = collections.deque(maxlen=SHORT)
        self.base: list[float] = []  # sorted(list(self.durs)[:-SHORT])
        self.jumped = False

    def rows(self, rows) -> None:
        for r in rows:
            step, start, end = r[0], r[1], r[2]
            if end > start:
                self.step((end - start) / 1e6, step)

    def step(self, dur: float, step: int) -> None:
        d, base = self.durs, self.base
        n = len(base)
        if n >= MIN_HISTORY:
            med, p90 = base[n // 2], base[(9 * (n - 1)) // 10]
            # a step far out of the recent range: 3x the median, 5 ms, and 4x the spread above it
            if dur - med >= max(SLOW_MIN_MS, (SLOW_FACTOR - 1) * med, 4 * (p90 - med)):
                self.on_anomaly(step, "slow_step", step, {"step_ms": round(dur, 3),
                                                          "median_ms": round(med, 3)})
        if len(d) == d.maxlen:  # the oldest leaves the baseline
            del base[bisect.bisect_left(base, d[0])]
        if len(d) >= SHORT:  # the step leaving the recent ones joins it
            bisect.insort(base, d[-SHORT])
        d.append(dur)
        self.steps.append(step)
        n = len(base)
        if n < MIN_HISTORY:
            return
        med, p90 = base[n // 2], base[(9 * (n - 1)) // 10]
        if dur < JUMP_FACTOR * med and not self.jumped:
            return  # (the recent median rises past the level with a step above it: most steps stop here)
        recent = list(itertools.islice(reversed(d), SHORT))[::-1]
        short = sorted(recent)
        short = (short[(SHORT - 1) // 2] + short[SHORT // 2]) / 2
        # a new level: 1.4x the median, 2 ms more, and above the baseline's usual range
        if short >= JUMP_FACTOR * med and short - med >= JUMP_MIN_MS and short > p90:
            if not self.jumped:
                self.jumped = True
                mid = (short + med) / 2
                anchor = next((s for s, x in zip(self.steps, recent) if x >= mid), step)
                self.on_anomaly(step, "step_time_jump", anchor,
                                {"step_ms": round(short, 3), "before_ms": round(med, 3)})
        elif self.jumped and short < (1 + (JUMP_FACTOR - 1) / 2) * med:
            self.jumped = False


class DetailWindows:
    """The windows of one stream of one rank (the collective log). ``ring`` (set by the compact
    store) is that stream's RingWriter: a window's steps before its anomaly are read back from
    the ring's files under the ring's lock (nothing is kept in memory for them, and a flush
    cannot slip between the read-back and the window's opening)."""

    def __init__(self, compact_dir, stream: str, total_bytes: int, on_change):
        self.dir = compact_dir
        self.stream = stream
        self.cap = max(4096, int(total_bytes) // MAX_WINDOWS)
        self.on_change = on_change
        self.lock = threading.Lock()
        self.ring = None
        self.windows: list[dict] = []  # oldest first; an open one holds its file's fd
        self.n_open = 0
        self.dropped = 0
        self.dropped_by_kind: dict[str, int] = {}
        self.kinds: set[str] = set()  # kinds of anomaly seen: their first window is kept

    # -- the ring's flushes (under the ring's lock)
    def feed(self, recs, data: bytes) -> None:
        if not self.n_open:  # (every flush of the log: nothing more unless a window is open)
            return
        lo, hi = _steps_of(recs)
        if lo is None:
            return
        changed = False
        with self.lock:
            for w in self.windows:
                if w["closed"]:
                    continue
                if lo > w["last"]:
                    changed |= self._close(w)
                elif hi >= w["first"]:
                    changed |= self._append(w, data)
        if changed:
            self.on_change()

    # -- anomalies (the flushing thread; the NaN watch's writer)
    def anomaly(self, step: int, kind: str, anchor: int | None = None, info=None) -> None:
        anchor = step if anchor is None else min(anchor, step)
        first, last = max(0, anchor - WINDOW_STEPS), step + WINDOW_STEPS
        note = {"kind": kind, "step": int(step), **(info or {})}
        ring_lock = getattr(self.ring, "_lock", None) or threading.Lock()
        with ring_lock, self.lock:  # (the order feed() takes them in: the ring's, then ours)
            for w in reversed(self.windows):
                inside = w["first"] <= step <= w["last"]
                if inside or (not w["closed"] and first <= w["last"] + 1 and last >= w["first"]):
                    if not w["closed"]:
                        w["last"] = max(w["last"], last)  # a burst: one window, extended
                    if len(w["anomalies"]) < 8:
                        w["anomalies"].append(note)
                    if kind not in self.kinds:  # this kind's first anomaly: its onset
                        self.kinds.add(kind)
                        w["onset"] = True
                    break
            else:
                prev = max((w["last"] for w in self.windows), default=-1)
                first = max(first, prev + 1)  # never twice the same step
                if first > last:  # (a step between two kept windows: the later one's steps)
                    return
                while len(self.windows) >= MAX_WINDOWS:
                    # the oldest window but the onset ones (at most one per kind: always fewer)
                    i = next((i for i, x in enumerate(self.windows) if not x.get("onset")), 0)
                    self._drop(self.windows.pop(i))
                onset = kind not in self.kinds
                self.kinds.add(kind)
                w = {"stream": self.stream, "file": fmt.window_name(self.stream, first),
                     "first": first, "last": last, "anomalies": [note], "bytes": 0,
                     "closed": False, "truncated": False, "onset": onset, "fd": None}
                self.windows.append(w)
                self.n_open += 1
                before, whole_from = self._read_back(first)
                w["first"] = max(first, whole_from)
                if before:
                    self._append(w, before)
        self.on_change()

    def _read_back(self, first: int) -> tuple[bytes, int]:
        """(the ring's lines of steps ≥ ``first``, in file order, within this window's bytes;
        the first step they hold whole). The ring's files are read from their end back, at
        most ``cap`` bytes: a ring holding less than that of those steps starts them later."""
        ring = self.ring
        if ring is None:
            return b"", first
        chunks, left, reached = [], self.cap, False
        for p in (ring.path, ring.prev):
            try:
                with open(p, "rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    n = min(size, left + 1)  # one byte more: is the line before it whole?
                    f.seek(size - n)
                    data = f.read(n)
            except OSError:
                continue
            left -= len(data)
            cut = size - n > 0
            lines = data.split(b"\n")
            if lines and not lines[-1]:
                lines.pop()
            if cut and lines:
                lines.pop(0)  # a line cut by the read's start
            keep = []
            for line in reversed(lines):
                st = _line_step(line)
                if st is not None and st < first:
                    reached = True
                    break
                keep.append(line)
            chunks.insert(0, keep[::-1])
            if reached or left <= 0:
                break
        lines = [x for part in chunks for x in part]
        if not lines:
            return b"", first
        steps = [x for x in map(_line_step, lines) if x is not None]
        whole_from = first if reached or not steps else min(steps) + 1
        lines = [x for x in lines if (_line_step(x) or whole_from) >= whole_from]
        return b"".join(x + b"\n" for x in lines), whole_from

    def _append(self, w: dict, data: bytes) -> bool:
        if w["bytes"] + len(data) > self.cap:
            w["truncated"] = True
            return self._close(w)
        if w["fd"] is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            w["fd"] = os.open(self.dir / w["file"],
                              os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(w["fd"], view):]
        w["bytes"] += len(data)
        return False

    def _close(self, w: dict) -> bool:
        if not w["closed"]:
            w["closed"] = True
            self.n_open -= 1
        if w["fd"] is not None:
            try:
                os.close(w["fd"])
            except OSError:
                pass
            w["fd"] = None
        return True

    def _drop(self, w: dict) -> None:
        self._close(w)
        self.dropped += 1
        k = str(w["anomalies"][0].get("kind")) if w["anomalies"] else "?"
        self.dropped_by_kind[k] = self.dropped_by_kind.get(k, 0) + 1
        try:
            os.unlink(self.dir / w["file"])
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:
            for w in self.windows:
                self._close(w)

    def state(self) -> dict:
        with self.lock:
            return {"window_steps": WINDOW_STEPS, "max_windows": MAX_WINDOWS,
                    "window_bytes": self.cap, "dropped": self.dropped,
                    "dropped_by_kind": dict(self.dropped_by_kind),
                    "windows": [{k: v for k, v in w.items() if k != "fd"} for w in self.windows]}


_STEP = re.compile(rb'"step":(-?\d+)')


def _line_step(line: bytes) -> int | None:
    m = _STEP.search(line)
    return int(m.group(1)) if m else None


def _steps_of(recs) -> tuple:
    """(lowest, highest) step of a flush's records, from its first and last ones (a flush holds
    the records in the order they finished: steps ascending, give or take the boundary)."""
    try:
        a, b = recs[0].get("step"), recs[-1].get("step")
    except (IndexError, AttributeError):
        return None, None
    if type(a) is not int or type(b) is not int:
        return None, None
    return min(a, b), max(a, b)
