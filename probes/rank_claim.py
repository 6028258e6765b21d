"""Which process is a rank: the first process of a run to start probes for a rank identity claims it.

`trainprof wrap` makes every Python process of the job load the probes (PYTHONPATH), and a
process the job starts inherits its parent's environment: RANK, LOCAL_RANK, WORLD_SIZE... An
evaluation script a rank runs with ``subprocess.run([sys.executable, ...])`` (or a fork that
steps an optimizer) would otherwise take itself for that rank and write into its directory.

The process that starts a session records its claim in its own environment, which everything it
starts afterwards inherits::

    TRAINPROF_RANK_CLAIM={"pid": ..., "run_dir": ..., "rank": R, "world": W, "env": {RANK: ...}}

A later process of the same run with another pid stands aside (no probes) when it would be the
same rank: the rank variables of its environment are those of the claim (a child that inherited
them), or, where the claimant had none (a plain ``python train.py``), its own rank and world size
are the claimant's. Legitimate ranks started by another rank still differ: Lightning's launcher
gives each child its own LOCAL_RANK, and mp.spawn children join the process group with their own
rank. A process under another torchrun launch than the claimant's (TORCHELASTIC_RUN_ID: a job
a rank launches itself) is not a rank of this run either. Processes started before the claim (or
by a launcher that never claims, such as the torchrun agent) are decided as before.
"""

from __future__ import annotations

import json
import os

ENV = "TRAINPROF_RANK_CLAIM"
# Environment variables that tell launched ranks apart (torchrun, Lightning, SLURM, MPI).
ID_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID",
           "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


LAUNCH_KEY = "TORCHELASTIC_RUN_ID"  # one per torchrun launch: a rank's own torchrun has another


def env_identity(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in ID_KEYS if k in environ}


def _same_dir(a, b) -> bool:
    try:
        return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))
    except (TypeError, ValueError):
        return False


def _effective_rank() -> tuple[int, int]:
    """(rank, world size) a session started now would record (probes/rankinfo.py identity())."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def stands_aside(run_dir) -> bool:
    """True when another process of this run already is the rank this process would be."""
    raw = os.environ.get(ENV)
    if not raw:
        return False
    try:
        claim = json.loads(raw)
        if int(claim["pid"]) == os.getpid() or not _same_dir(claim["run_dir"], run_dir):
            return False
        env = claim.get("env") or {}
        run_id = claim.get("launch")
        if run_id and os.environ.get(LAUNCH_KEY, run_id) != run_id:
            return True  # a job launched by a rank (a nested torchrun): not a rank of this run
        if env:
            return env_identity() == env
        return _effective_rank() == (int(claim["rank"]), int(claim["world"]))
    except Exception:  # noqa: BLE001 - an unreadable claim decides nothing
        return False


def claim(run_dir, rank: int, world: int) -> None:
    """Record that this process is ``rank`` of the run (inherited by the processes it starts)."""
    os.environ[ENV] = json.dumps({"pid": os.getpid(), "run_dir": os.path.abspath(os.fspath(run_dir)),
                                  "rank": int(rank), "world": int(world), "env": env_identity(),
                                  "launch": os.environ.get(LAUNCH_KEY)},
                                 separators=(",", ":"))


def release() -> None:
    """Withdraw this process's claim (its session ended: trainprof.session() left, a test)."""
    raw = os.environ.get(ENV)
    try:
        if raw and int(json.loads(raw)["pid"]) == os.getpid():
            del os.environ[ENV]
    except Exception:  # noqa: BLE001
        pass
