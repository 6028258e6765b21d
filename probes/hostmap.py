"""Which host every rank of the job runs on, known to each node (meta.json ``hosts``).

A run directory of one node (per-node --out) holds only that node's ranks; to name the host of a
rank that left no files ("missing: 8–15 (host node001)") each node needs the others' hosts. At
start every rank writes its host name into torch.distributed's default store (one key, on a
connection of its own, on a daemon thread: the job never waits), and the local rank 0 of each
node waits for all the keys and records the map in its meta.json as ``{"host": "0-7,16-23"}``.
A job without torch.distributed records nothing.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

from trainprof.probes import runtime

PREFIX = "trainprof/hosts"
WAIT_S = 120.0


def _run(session) -> None:
    try:
        import torch.distributed as dist

        from trainprof.probes.clock import own_client
        from trainprof.probes.profile_ranks import ranges

        runtime.name_native_thread()
        store = own_client(dist.distributed_c10d._get_default_store())
        world = dist.get_world_size()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{attempt}"
        store.set(f"{prefix}/{session.rank}", socket.gethostname())
        if int(session.meta.get("local_rank") or 0) != 0 or world <= 1:
            return
        keys = [f"{prefix}/{r}" for r in range(world)]
        store.wait(keys, timedelta(seconds=WAIT_S))
        values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        by_host: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_host.setdefault(bytes(v).decode(errors="replace"), []).append(r)
        session.update_meta(hosts={h: ranges(rs) for h, rs in sorted(by_host.items())})
    except Exception:  # noqa: BLE001 - a hint for the analysis only: a job whose peers died
        pass  # (store gone, keys never set) says nothing more about it


class _Starter:
    def __init__(self, session):
        self.session, self.started = session, False

    def maybe_start(self, _rec=None) -> None:
        if self.started:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return  # not yet: tried again at the next step
        self.started = True
        threading.Thread(target=_run, args=(self.session,), daemon=True,
                         name="trainprof-hosts").start()


def attach(session) -> None:
    starter = _Starter(session)
    starter.maybe_start()
    session.on_step(starter.maybe_start)
