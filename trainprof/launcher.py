"""Run a job under the probes: prepare the run directory, start the command with the bootstrap
on PYTHONPATH, forward signals, and record how it ended. Used by `trainprof wrap` and `demo`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from trainprof import __version__
from trainprof.probes import runtime
from trainprof.rundir import (INJECTED, MANIFEST, PROFILER_DIR, RANKS_DIR, REPORT, SCHEMA_VERSION,
                              SUMMARY, collect_rank_entries, write_json_atomic)

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
RELEVANT_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "OMP_", "SLURM_", "MASTER_",
                         "WORLD_SIZE", "GLOO_", "TRAINPROF_")
OWNED_ENTRIES = (MANIFEST, RANKS_DIR, PROFILER_DIR, SUMMARY, REPORT, INJECTED)


class LaunchError(Exception):
    pass


def prepare_run_dir(out: Path, force: bool) -> None:
    """Refuse to mix a new run into an existing one; with force, remove only what a previous
    trainprof run wrote (never other files the user keeps there)."""
    if out.exists() and not out.is_dir():
        raise LaunchError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise LaunchError(
                f"{out}: not empty (a previous run?). Use --out NEW_DIR, or --force to replace "
                f"the trainprof files in it.")
        for name in OWNED_ENTRIES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def job_env(out: Path, profile_steps: str | None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOTSTRAP_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[runtime.ENV_RUN_DIR] = str(out.resolve())
    if profile_steps is not None:
        env[runtime.ENV_PROFILE_STEPS] = profile_steps
    env.update(extra or {})
    return env


def _now() -> dict:
    return {"iso": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "ns": time.time_ns()}


def run_job(cmd: list[str], out: Path, profile_steps: str | None = None,
            env_extra: dict | None = None, config: dict | None = None) -> tuple[int, int | None]:
    """Run cmd to completion with probes active. Returns (exit_code, signal_or_None), where
    exit_code follows the shell convention (128+N when the job died of signal N)."""
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": "trainprof-run",
        "command": list(cmd),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "trainprof_version": __version__,
        "python": sys.version.split()[0],
        "launcher_pid": os.getpid(),
        "start_time": _now(),
        "config": {"profile_steps": profile_steps, **(config or {})},
        "env": {k: v for k, v in os.environ.items() if k.startswith(RELEVANT_ENV_PREFIXES)},
        "status": "running",
    }
    write_json_atomic(out / MANIFEST, manifest)
    try:
        proc = subprocess.Popen(cmd, env=job_env(out, profile_steps, env_extra),
                                process_group=0)
    except OSError as e:
        manifest.update(status="failed_to_start", end_time=_now(), error=str(e))
        write_json_atomic(out / MANIFEST, manifest)
        raise LaunchError(f"cannot start {cmd[0]!r}: {e.strerror or e}") from e

    # The job runs in its own process group; signals sent to us (Ctrl-C reaches only our group)
    # are passed on to the whole job group, as a terminal would have done without us.
    def forward(signum, frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    sig = -rc if rc < 0 else None
    code = 128 + sig if sig else rc
    manifest.update(end_time=_now(), exit_code=code, signal=sig,
                    signal_name=signal.Signals(sig).name if sig else None,
                    status="ok" if rc == 0 else ("killed" if sig else "failed"))
    try:  # every rank's identity and mesh coordinates, gathered from the ranks' meta.json
        manifest.update(collect_rank_entries(out))
    except Exception as e:  # noqa: BLE001
        manifest["rank_entries_error"] = str(e)
    write_json_atomic(out / MANIFEST, manifest)
    return code, sig


def exit_like(code: int, sig: int | None) -> None:
    """Leave this process the way the job left: same exit code, or death by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if sig:
        try:
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these cannot be caught anyway
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        except (OSError, ValueError):
            pass
    os._exit(code) if sig else sys.exit(code)
