"""The Python API for users who prefer code to `trainprof wrap`.

    import trainprof
    with trainprof.session("traces/"):        # not needed under `trainprof wrap`
        for batch in data:
            train_step(batch)
            trainprof.step()                   # optional: explicit step boundary

    trainprof.set_run_info(tokens_per_step=..., n_params=...)   # feeds throughput and MFU

Every function here is safe to call when no probes are active: it does nothing (or remembers
the information for when probes activate) and never raises into the job.
"""

from __future__ import annotations

import contextlib
import os

from trainprof.probes import bootstrap, runtime
from trainprof.probes.rank_claim import ENV as ENV_CLAIM


def step() -> None:
    """Mark a step boundary explicitly. Once a job calls this, optimizer-step hooks stop
    counting steps for it (the explicit marker wins)."""
    s = runtime.active()
    if s is not None:
        s.mark_step(source="marker")


def set_run_info(**info) -> None:
    """Declare facts about the job that traces cannot show: tokens_per_step, n_params,
    n_layers, hidden, heads, seq_len, vocab, global_batch, micro_batches, schedule, ...
    Stored in every rank's meta.json under "run_info"."""
    runtime.remember_run_info(info)


@contextlib.contextmanager
def session(out: str | os.PathLike = "traces", profile_steps: str | None = None):
    """Activate the probes in this process for the duration of the block (for jobs not started
    under `trainprof wrap`). Safe to nest inside a wrapped job: the wrapped session wins."""
    existing = runtime.active()
    if existing is not None:
        yield existing
        return

    saved = {k: os.environ.get(k) for k in (runtime.ENV_RUN_DIR, runtime.ENV_PROFILE_STEPS, ENV_CLAIM)}
    os.environ[runtime.ENV_RUN_DIR] = os.fspath(out)
    if profile_steps is not None:
        os.environ[runtime.ENV_PROFILE_STEPS] = profile_steps

    bootstrap.install_hooks()
    s = runtime.activate(reason="session")
    try:
        yield s
    finally:
        runtime.shutdown()
        for k, v in saved.items():  # after the block, optimizer steps must not re-activate
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
