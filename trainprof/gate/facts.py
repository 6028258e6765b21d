"""What a run is, for `trainprof compare` to refuse comparing unlike runs: its environment
fingerprint (device, world size, mesh, torch version) and its job facts (script, framework,
model and batch)."""

from __future__ import annotations

from collections.abc import Mapping

from trainprof.gate.metrics import get_path

FINGERPRINT = (("device", "run.device"), ("world_size", "run.world_size"), ("mesh", "run.mesh"),
               ("torch_version", "run.torch_version"))


def fingerprint(summary: Mapping) -> dict:
    return {name: get_path(summary, path) for name, path in FINGERPRINT}


def fingerprint_mismatches(base: Mapping, cand: Mapping) -> list[str]:
    fb, fc = fingerprint(base), fingerprint(cand)
    return [f"{k}: baseline {fb[k]!r}, candidate {fc[k]!r}" for k in fb if not same_fact(k, fb[k], fc[k])]


def same_fact(name: str, a, b) -> bool:
    """Equal, where a mesh one side does not know ({}: a summary written before plain DDP jobs
    got their dp size) is not a difference."""
    if name == "mesh" and (not a or not b):
        return True
    return a == b


# What the job is, as the probes recorded it (run.run_info: framework and model facts) and the
# script it ran. Compared only where both runs know the fact: an absent one proves nothing.
JOB_FACTS = (("script", None), ("framework", "run.run_info.framework"),
             ("model parameters (non-embedding)", "run.run_info.n_params_non_embedding"),
             ("layers", "run.run_info.layers"), ("hidden size", "run.run_info.hidden"),
             ("attention heads", "run.run_info.heads"), ("vocabulary", "run.run_info.vocab"),
             ("sequence length", "run.run_info.seq_len"),
             ("global batch", "run.run_info.global_batch"),
             ("gradient accumulation steps", "run.run_info.gradient_accumulation_steps"),
             ("tokens per step", "run.run_info.tokens_per_step"), ("dtype", "run.run_info.dtype"))


# `python -m` of these is a launcher (torchrun's module, its predecessor): the job is what it runs
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


def _script(summary: Mapping) -> str | None:
    """The job's script (file name of the first *.py argument, or the -m module; a launcher's
    module, as in ``python -m torch.distributed.run train.py``, is not the job)."""
    cmd = get_path(summary, "run.command")
    if not isinstance(cmd, list):
        return None
    for i, a in enumerate(cmd):
        a = str(a)
        if a == "-m" and i + 1 < len(cmd) and str(cmd[i + 1]) not in LAUNCHER_MODULES:
            return f"-m {cmd[i + 1]}"
        if a.endswith(".py"):
            return a.replace("\\", "/").rsplit("/", 1)[-1]
    return None


def job_facts(summary: Mapping) -> dict:
    out = {}
    for name, path in JOB_FACTS:
        v = _script(summary) if path is None else get_path(summary, path)
        if v is not None and v != "":
            out[name] = v
    return out


def job_differences(base: Mapping, other: Mapping) -> list[tuple[str, object, object]]:
    """(fact, baseline value, other value) for every job fact both runs know and that differs."""
    fb, fo = job_facts(base), job_facts(other)
    return [(k, fb[k], fo[k]) for k in fb if k in fo and fb[k] != fo[k]]
