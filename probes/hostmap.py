"""Which host every rank of the job runs on, known to each node (meta.json ``hosts``).

A run directory of one node (per-node --out) holds only that node's ranks; to name the host of a
rank that left no files ("missing: 8–15 (host node001)") each node needs the others' hosts. At
start every rank writes its host name into torch.distributed's default store (one key, and one
increment of a counter, on a connection of its own, on a daemon thread: the job never waits),
and the local rank 0 of each node polls the counter until every rank has written (up to WAIT_S),
then records the map in its meta.json as ``{"host": "0-7,16-23"}``. A job without
torch.distributed records nothing.

The thread never blocks inside a store call: a C++ call that returns while the interpreter is
shutting down ends the process with std::terminate (exit code 134) on Python 3.11, so it polls a
counter (one tiny request, then a Python sleep) rather than waiting on the store, stops once the
job destroys its process group, and an atexit hook stops it before the interpreter finalizes
(waiting, at most clock.EXIT_WAIT_S, for a call in flight to return).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time

from trainprof.probes import runtime
from trainprof.probes.clock import Stop  # store calls refused (and awaited) at exit
from trainprof.probes.clock import own_client
from trainprof.rankranges import ranges

PREFIX = "trainprof/hosts"
WAIT_S = 120.0
POLL_S = (0.05, 1.0)  # first and longest pause between two polls of the counter


def _run(session, guard: Stop | None = None) -> None:
    guard = guard or Stop()
    try:
        import torch.distributed as dist

        runtime.name_native_thread()
        default = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        store = guard.call(own_client, default)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{attempt}"
        guard.call(store.set, f"{prefix}/{session.rank}", socket.gethostname())
        count = f"{prefix}/count"
        done = guard.call(store.add, count, 1)
        if int(session.meta.get("local_rank") or 0) != 0 or world <= 1:
            return
        deadline, pause = time.monotonic() + WAIT_S, POLL_S[0]
        while done < world:
            if time.monotonic() >= deadline:
                return  # some rank never wrote (no probes there): no map
            time.sleep(pause)
            pause = min(POLL_S[1], pause * 2)
            if not dist.is_initialized():
                return  # the job destroyed its process group: its store may be gone
            done = guard.call(store.add, count, 0)
        keys = [f"{prefix}/{r}" for r in range(world)]
        values = (guard.call(store.multi_get, keys) if hasattr(store, "multi_get")
                  else [guard.call(store.get, k) for k in keys])
        by_host: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_host.setdefault(bytes(v).decode(errors="replace"), []).append(r)
        session.update_meta(hosts={h: ranges(rs) for h, rs in sorted(by_host.items())})
    except Exception:  # noqa: BLE001 - a hint for the analysis only: a job whose peers died
        pass  # (store gone, keys never set) or that is exiting says nothing more about it


class _Starter:
    def __init__(self, session):
        self.session, self.started = session, False
        self.guard = Stop()

    def maybe_start(self, _rec=None) -> None:
        if self.started:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return  # not yet: tried again at the next step
        self.started = True
        atexit.register(self.guard.set)
        threading.Thread(target=_run, args=(self.session, self.guard), daemon=True,
                         name="trainprof-hosts").start()


def attach(session) -> None:
    starter = _Starter(session)
    starter.maybe_start()
    session.on_step(starter.maybe_start)
