"""Clock offset of this rank to rank 0 (clock.jsonl), estimated at start and at close.

One host has one wall clock: a rank on rank 0's host (the same host name, the rule the analysis
applies, analyzers/_clock.py) records offset 0 without measuring (``"rounds": 0, "same_host":
true``), so a job of many ranks on one host costs one store read per rank, not a round trip
protocol that rank 0 answers one rank after the other (at 64 ranks on 2 cores that never
finished: every rank polled the store ~100 times a second for the whole run, and waited its
5 s end budget at exit).

For ranks on other hosts: NTP-style round trips through torch.distributed's default store (the
TCPStore every rank already talks to): rank r writes a ping stamped t0 with its own clock, rank
0 notes t1 when it sees the ping and t2 when it answers, rank r notes t3 when the answer
arrives. Then

    offset = ((t1 - t0) + (t2 - t3)) / 2      (add to local ns to get rank 0's clock)
    uncertainty = ((t3 - t0) - (t2 - t1)) / 2  (half the round trip: bounds the error)

and the round with the smallest round trip wins. How rank 0 learns whom to answer: it publishes
its host name; every other rank reads it, registers itself when its host differs (a counter and
one key), then counts itself as decided. Rank 0 answers the registered ranks one after the other
as they come, until every rank has decided (or its time is up).

The start estimate runs on a daemon thread so the job never waits for it; the end estimate
runs at close with short timeouts, because other ranks may already be gone; ranks on rank 0's
host, and rank 0 when every rank shares its host, skip it without a store call. A process dying
of an uncaught exception or sys.exit(non-zero) (probes/heartbeat_exit.py) skips the end
estimate: it never waits on its peers (the launcher stops them only once it has exited). A rank
that gets no answer in time writes nothing for that phase (analyzers then fall back to the other
phase or to no correction).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from datetime import timedelta

from trainprof import settings
from trainprof.probes import heartbeat_exit, runtime

REF_RANK = 0
ROUNDS = 8
PREFIX = "trainprof/clock"
ENV_START_TIMEOUT = "TRAINPROF_CLOCK_TIMEOUT_S"   # per rank, start phase (default 60)
ENV_END_TIMEOUT = "TRAINPROF_CLOCK_END_TIMEOUT_S"  # whole end phase (default 5)


def estimate(t0: int, t1: int, t2: int, t3: int) -> tuple[float, float]:
    """(offset_ns, uncertainty_ns) of one round trip."""
    return ((t1 - t0) + (t2 - t3)) / 2, ((t3 - t0) - (t2 - t1)) / 2


POLL_S = (5e-5, 0.01)  # first and longest pause between two checks for a key
WAIT_POLL_S = (0.01, 0.25)  # the same while waiting for rank 0's host name or for registrations
HOST_KEY, DECIDED, REMOTE_N, REMOTE = "host", "decided", "remote_n", "remote"
EXIT_WAIT_S = 2.0      # at exit: how long the start thread gets to leave its store call


class Stop:
    """Ends the start-phase thread's store traffic before the interpreter finalizes: a store
    call in flight on a daemon thread at finalization aborts the process (or prints C++ stack
    traces on the job's stderr). set() refuses further calls and waits for the one in flight."""

    def __init__(self):
        self.pid = os.getpid()
        self.stopped = False
        self.lock = threading.Lock()
        self.idle = threading.Event()
        self.idle.set()

    def call(self, fn, *args):
        with self.lock:
            if not self.stopped and not _dist_alive():
                # the job destroyed its process group: the store's host may be gone with it,
                # and a check on a closed connection prints C++ warnings on the job's stderr
                self.stopped = True
            if self.stopped:
                raise RuntimeError("process exiting")
            self.idle.clear()
        try:
            return fn(*args)
        finally:
            self.idle.set()

    def set(self) -> None:
        if os.getpid() != self.pid:  # a forked child exiting: the thread is not in it
            return
        with self.lock:
            self.stopped = True
        self.idle.wait(EXIT_WAIT_S)


def _dist_alive() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _await(store, key: str, seconds: float, stop: Stop | None, poll=POLL_S) -> bool:
    """True once ``key`` exists, False after ``seconds``. Polls with the store's non-blocking
    check (a blocking wait that times out prints C++ warnings on the job's stderr, and cannot
    be interrupted at exit); pauses grow from 50 µs to 10 ms (``poll``), so an answer that comes
    at once is seen within about a round trip, and a silent peer costs ~100 checks a second."""
    call = stop.call if stop is not None else (lambda fn, *a: fn(*a))
    deadline, pause = time.monotonic() + seconds, poll[0]
    while True:
        if call(store.check, [key]):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(poll[1], pause * 1.5)


def ping(store, rank: int, phase: str, rounds: int = ROUNDS, timeout_s: float = 60.0,
         now=time.time_ns, stop: Stop | None = None) -> tuple[float, float, int] | None:
    """Client side (any rank but the reference): the best round's (offset, uncertainty, local
    time of its ping), or None when the reference did not answer in time."""
    best = None
    deadline = time.monotonic() + timeout_s
    for i in range(rounds):
        key = f"{PREFIX}/{phase}/{rank}/{i}"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        t0 = now()
        try:
            (stop.call if stop else lambda fn, *a: fn(*a))(store.set, key + "/ping", str(t0))
            if not _await(store, key + "/pong", left, stop):
                break
        except Exception:  # noqa: BLE001 - the store is gone, or the process is exiting
            break
        t3 = now()
        t1, t2 = (int(x) for x in store.get(key + "/pong").decode().split(","))
        est = estimate(t0, t1, t2, t3)
        if best is None or est[1] < best[1]:
            best = (est[0], est[1], t0)
    return best


def serve(store, ranks, phase: str, rounds: int = ROUNDS, timeout_s: float = 60.0,
          now=time.time_ns, deadline_s: float | None = None, stop: Stop | None = None) -> list[int]:
    """Reference side: answer every round of every rank; returns the ranks that took part.
    A rank silent for timeout_s (or past the overall deadline) is skipped."""
    served = []
    end = time.monotonic() + deadline_s if deadline_s is not None else None
    for r in ranks:
        ok = True
        for i in range(rounds):
            key = f"{PREFIX}/{phase}/{r}/{i}"
            wait = timeout_s if end is None else min(timeout_s, end - time.monotonic())
            if wait <= 0:
                return served
            try:
                if not _await(store, key + "/ping", wait, stop):
                    ok = False
                    break
                t1 = now()
                t2 = now()
                (stop.call if stop else lambda fn, *a: fn(*a))(store.set, key + "/pong", f"{t1},{t2}")
            except Exception:  # noqa: BLE001 - the store is gone, or the process is exiting
                return served
        if ok:
            served.append(r)
    return served


def _host() -> str:
    """This host's name, as meta.json records it (probes/rankinfo.py) and the analysis compares."""
    return socket.gethostname()


def _calls(stop: Stop | None):
    return stop.call if stop is not None else (lambda fn, *a: fn(*a))


def decide(store, rank: int, host: str, host_registry: str, registry: str, timeout_s: float,
           stop: Stop | None = None) -> bool | None:
    """A rank other than the reference: read rank 0's host name (published in
    ``host_registry``, waiting up to ``timeout_s``); on another host, register this rank in
    ``registry`` for round trips; then count it there as decided. True: rank 0's host (nothing
    to measure); False: registered; None: rank 0's host name never came (nothing counted)."""
    call = _calls(stop)
    key = f"{host_registry}/{HOST_KEY}"
    if not _await(store, key, timeout_s, stop, WAIT_POLL_S):
        return None
    same = bytes(call(store.get, key)).decode(errors="replace") == host
    if not same:  # registered before counted: rank 0 sees every registration once all counted
        i = int(call(store.add, f"{registry}/{REMOTE_N}", 1)) - 1
        call(store.set, f"{registry}/{REMOTE}/{i}", str(rank))
    call(store.add, f"{registry}/{DECIDED}", 1)
    return same


def serve_registered(store, world: int, registries: list[str], phase: str,
                     timeout_s: float = 60.0, deadline_s: float | None = None,
                     stop: Stop | None = None, now=time.time_ns) -> tuple[list[int], int, bool]:
    """Reference side: answer the round trips of the ranks registered in ``registries`` (those
    on other hosts), each as it registers, until every other rank has decided (the registries'
    counters sum to world - 1) or the time is up (``deadline_s`` overall, else ``timeout_s``).
    Returns (ranks served, ranks registered, every rank decided)."""
    call = _calls(stop)
    end = time.monotonic() + (deadline_s if deadline_s is not None else timeout_s)
    seen = [0] * len(registries)
    served: list[int] = []
    pause = WAIT_POLL_S[0]
    while True:
        try:
            # the count first: a rank registers before it counts itself, so once all are
            # counted, the registrations read next are all of them
            decided = sum(int(call(store.add, f"{reg}/{DECIDED}", 0)) for reg in registries)
            for k, reg in enumerate(registries):
                n = int(call(store.add, f"{reg}/{REMOTE_N}", 0))
                while seen[k] < n:
                    key = f"{reg}/{REMOTE}/{seen[k]}"
                    left = end - time.monotonic()
                    if left <= 0 or not _await(store, key, left, stop):
                        return served, sum(seen), False
                    r = int(bytes(call(store.get, key)).decode())
                    seen[k] += 1
                    served += serve(store, [r], phase, timeout_s=timeout_s, now=now,
                                    deadline_s=end - time.monotonic(), stop=stop)
                    pause = WAIT_POLL_S[0]
        except Exception:  # noqa: BLE001 - the store is gone, or the process is exiting
            return served, sum(seen), False
        if decided >= world - 1:
            return served, sum(seen), True
        left = end - time.monotonic()
        if left <= 0:
            return served, sum(seen), False
        time.sleep(min(pause, left))
        pause = min(WAIT_POLL_S[1], pause * 1.5)


def own_client(store):
    """A new client connection to the TCPStore behind ``store`` (unwrapping PrefixStores), or
    ``store`` itself for other store types."""
    import torch.distributed as dist

    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        return dist.TCPStore(inner.host, inner.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=30))
    return store


class ClockProbe:
    def __init__(self, session):
        self.session = session
        self.writer = session.stream("clock")
        self.store = None
        self.world = 1
        self.started = False
        self.lock = threading.Lock()
        self.same_host: bool | None = None  # this rank is on rank 0's host (decided at start)
        self.published = False              # rank 0: its host name is in the store
        self.registered = 0                 # rank 0: ranks on other hosts registered at start
        self.start_complete = False         # rank 0: every rank decided at start

    def _init_dist(self) -> bool:
        if self.store is not None:
            return True
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        self.world = dist.get_world_size()
        # A connection of our own: a TCPStore client serializes its operations, so waiting on
        # the job's client would stall the job's own store traffic (group creation). Kept for
        # the end phase: destroy_process_group() drops the default store.
        self.store = own_client(dist.distributed_c10d._get_default_store())
        return True

    def start(self) -> None:
        with self.lock:
            if self.started or not self._init_dist():
                return
            self.started = True
        timeout = settings.value(ENV_START_TIMEOUT)
        stop = Stop()
        atexit.register(stop.set)
        threading.Thread(target=self._run, args=("start", timeout, None, stop), daemon=True,
                         name="trainprof-clock").start()

    def on_step(self, _rec=None) -> None:
        if not self.started:
            self.start()  # dist was not initialized when the probes attached

    def end(self) -> None:
        if not self.started or self.store is None:
            return

        if heartbeat_exit.failure() is not None:
            return  # dying of an error: peers may be gone, and must not wait for this one
        budget = settings.value(ENV_END_TIMEOUT)
        self._run("end", budget, budget)

    def _run(self, phase, timeout_s, deadline_s, stop: Stop | None = None) -> None:
        runtime.name_native_thread()  # on the trainprof-clock thread only
        # keys of an earlier attempt of an elastic job live on in the agent's store
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{attempt}"
        key_phase = f"{base}-{phase}"
        start_registry, registry = f"{PREFIX}/{base}-start", f"{PREFIX}/{key_phase}"
        try:
            rank = self.session.rank
            if rank == REF_RANK:
                t = time.time_ns()
                if not self.published:  # where rank 0 runs, for every rank to compare
                    _calls(stop)(self.store.set, f"{start_registry}/{HOST_KEY}", _host())
                    self.published = True
                if phase == "start":
                    _, self.registered, self.start_complete = serve_registered(
                        self.store, self.world, [registry], key_phase, timeout_s=timeout_s,
                        deadline_s=deadline_s, stop=stop)
                elif not (self.start_complete and self.registered == 0):
                    # the ranks registered at start, and those that decide only now
                    serve_registered(self.store, self.world, [start_registry, registry],
                                     key_phase, timeout_s=timeout_s, deadline_s=deadline_s,
                                     stop=stop)
                # else every rank shares this host: nothing to answer, no store call at exit
                self.writer.write({"phase": phase, "ref_rank": REF_RANK, "offset_ns": 0,
                                   "uncertainty_ns": 0, "t_ns": t})
                return
            same = self.same_host
            if same is None:  # not decided at start (or this is the start)
                same = decide(self.store, rank, _host(), start_registry, registry, timeout_s,
                              stop)
                self.same_host = same
            if stop is not None and stop.stopped:
                return  # the process is exiting: nothing to say
            if same is None:
                runtime.warn(f"clock {phase}: no answer from rank {REF_RANK}; offset not recorded")
                return
            if same:  # one host, one wall clock: offset 0, nothing measured
                self.writer.write({"phase": phase, "ref_rank": REF_RANK, "offset_ns": 0,
                                   "uncertainty_ns": 0, "t_ns": time.time_ns(), "rounds": 0,
                                   "same_host": True})
                return
            best = ping(self.store, rank, key_phase, timeout_s=timeout_s, stop=stop)
            if stop is not None and stop.stopped:
                return  # the process is exiting: nothing to say
            if best is None:
                runtime.warn(f"clock {phase}: no answer from rank {REF_RANK}; offset not recorded")
                return
            self.writer.write({"phase": phase, "ref_rank": REF_RANK, "offset_ns": round(best[0]),
                               "uncertainty_ns": round(best[1]), "t_ns": best[2],
                               "rounds": ROUNDS})
        except Exception as e:  # noqa: BLE001
            if stop is None or not stop.stopped:
                runtime.warn(f"clock {phase} estimate failed: {type(e).__name__}: {e}")


def attach(session) -> None:
    heartbeat_exit.install()  # end() asks it whether this process is failing
    probe = ClockProbe(session)
    session.state["clock_probe"] = probe
    probe.start()
    session.on_step(probe.on_step)
    session.on_close(probe.end)
