"""Clock offset of this rank to rank 0 (clock.jsonl), estimated at start and at close.

NTP-style round trips through torch.distributed's default store (the TCPStore every rank
already talks to): rank r writes a ping stamped t0 with its own clock, rank 0 notes t1 when it
sees the ping and t2 when it answers, rank r notes t3 when the answer arrives. Then

    offset = ((t1 - t0) + (t2 - t3)) / 2      (add to local ns to get rank 0's clock)
    uncertainty = ((t3 - t0) - (t2 - t1)) / 2  (half the round trip: bounds the error)

and the round with the smallest round trip wins. Rank 0 answers the ranks one after the other.
The start estimate runs on a daemon thread so the job never waits for it; the end estimate
runs at close with short timeouts, because other ranks may already be gone. A process dying of
an uncaught exception or sys.exit(non-zero) (probes/heartbeat_exit.py) skips the end estimate:
it never waits on its peers (the launcher stops them only once it has exited). A rank that gets
no answer in time writes nothing for that phase (analyzers then fall back to the other phase
or to no correction).
"""

from __future__ import annotations

import atexit
import os
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


def _await(store, key: str, seconds: float, stop: Stop | None) -> bool:
    """True once ``key`` exists, False after ``seconds``. Polls with the store's non-blocking
    check (a blocking wait that times out prints C++ warnings on the job's stderr, and cannot
    be interrupted at exit); pauses grow from 50 µs to 10 ms, so an answer that comes at once
    is seen within about a round trip, and a silent peer costs ~100 checks a second."""
    call = stop.call if stop is not None else (lambda fn, *a: fn(*a))
    deadline, pause = time.monotonic() + seconds, POLL_S[0]
    while True:
        if call(store.check, [key]):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(POLL_S[1], pause * 1.5)


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
        key_phase = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{attempt}-{phase}"
        try:
            rank = self.session.rank
            if rank == REF_RANK:
                t = time.time_ns()
                serve(self.store, [r for r in range(self.world) if r != REF_RANK], key_phase,
                      timeout_s=timeout_s, deadline_s=deadline_s, stop=stop)
                self.writer.write({"phase": phase, "ref_rank": REF_RANK, "offset_ns": 0,
                                   "uncertainty_ns": 0, "t_ns": t})
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
