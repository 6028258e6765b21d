"""How each worker of a torchrun job ended, recorded by the torchrun agent itself.

A rank killed by SIGKILL writes nothing more; only its parent saw how it ended. Under `trainprof
wrap -- torchrun ...` the agent process (torch.distributed.run) is a Python process of the job
too, so the bootstrap patches its process context: when the agent closes its workers (because
one failed, or all finished, or it was told to stop), ``PContext.close`` is wrapped to record,
before and after the close, every worker's global rank, pid and exit status into
RUN/worker-exits.jsonl (one line per close, O_APPEND; one file for all the nodes' agents)::

    {"t_ns", "event": "workers_closed", "host", "agent_pid", "restart",
     "workers": [{"rank", "local_rank", "pid", "exitcode_at_close", "exitcode"}]}

``exitcode_at_close`` is the status a worker had already ended with when the agent began to close
the group (None: still running, so whatever ``exitcode`` says, the agent ended it); exit codes
follow subprocess (-N: signal N). Workers that had failed before the close are the ones that
made the agent stop the job: the first failures. Nothing here runs in the ranks themselves: only
the module that defines PContext triggers it, and only the agent imports that.
"""

from __future__ import annotations

import os
import socket
import time

from trainprof.probes import post_import, runtime
from trainprof.rundir.worker_exits import STREAM

MODULE = "torch.distributed.elastic.multiprocessing.api"
_patched = False


def install() -> None:
    """Arrange for the agent's process context to be patched (any process: a no-op in those
    that never import the elastic agent)."""
    try:
        post_import.when_imported(MODULE, patch)
    except Exception as e:  # noqa: BLE001 - never stop the job
        runtime.warn(f"worker exit recording unavailable: {type(e).__name__}: {e}")


def patch(module) -> None:
    global _patched
    if _patched:
        return
    try:
        pcontext = module.PContext
        original = pcontext.close
    except AttributeError as e:
        runtime.warn(f"worker exit recording unavailable in this torch: {e}")
        return
    _patched = True

    def close(self, *args, **kwargs):
        t_ns = time.time_ns()
        before = None
        if not getattr(self, "_trainprof_closed", False):  # the first close ends the workers
            try:
                self._trainprof_closed = True
                before = workers(self)
            except Exception:  # noqa: BLE001
                pass
        try:
            return original(self, *args, **kwargs)
        finally:
            if before:
                record(t_ns, before, self)

    close.__wrapped__ = original
    pcontext.close = close


def workers(ctx) -> dict[int, dict]:
    """{local_rank: {rank, local_rank, pid, exitcode}} of a process context, without waiting."""
    out = {}
    envs = getattr(ctx, "envs", None) or {}
    handlers = getattr(ctx, "subprocess_handlers", None)
    if handlers:  # SubprocessContext (torchrun with a script or module)
        procs = {lr: (h.proc.pid, h.proc.returncode) for lr, h in handlers.items()}
    else:  # MultiprocessContext (a function entrypoint): multiprocessing.Process objects
        pc = getattr(ctx, "_pc", None)
        procs = {lr: (p.pid, p.exitcode) for lr, p in enumerate(getattr(pc, "processes", None) or [])}
    for lr, (pid, code) in procs.items():
        env = envs.get(lr) or {}
        try:
            rank = int(env.get("RANK"))
        except (TypeError, ValueError):
            rank = None
        out[lr] = {"rank": rank, "local_rank": lr, "pid": pid, "exitcode": code}
    return out


def record(t_ns: int, before: dict, ctx) -> None:
    try:
        after = workers(ctx)
        run_dir = os.environ.get(runtime.ENV_RUN_DIR)
        if not run_dir:
            return
        from trainprof.rundir.files import dumps_compact  # lazy: start-up time of the job's bootstrap

        rows = []
        for lr, w in sorted(before.items()):
            end = (after or {}).get(lr, w)
            rows.append({"rank": w["rank"], "local_rank": lr, "pid": w["pid"],
                         "exitcode_at_close": w["exitcode"], "exitcode": end["exitcode"]})
        rec = {"t_ns": t_ns, "event": "workers_closed", "host": socket.gethostname(),
               "agent_pid": os.getpid(),
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0), "workers": rows}
        data = (dumps_compact(rec) + "\n").encode()
        fd = os.open(os.path.join(run_dir, STREAM), os.O_WRONLY | os.O_CREAT | os.O_APPEND
                     | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)  # one write: a kill tears at most this line
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - never stop the agent
        runtime.warn(f"could not record how the workers ended: {type(e).__name__}: {e}")
