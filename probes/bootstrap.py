"""Make probes activate in an unmodified training script.

`trainprof wrap` puts trainprof/_bootstrap on PYTHONPATH; its sitecustomize calls install() in
every Python process of the job. install() only registers a post-import hook for torch: nothing
happens in processes that never import torch. Once torch is imported we patch the points where
a job becomes distributed, and activate the probes at the first of:

  * torch.distributed.init_process_group() returning,
  * a DeviceMesh being created (init_device_mesh may initialize the process group itself),
  * the first optimizer step (covers single-process jobs),
  * a framework's train start (Trainer.train(), Lightning fit) in a single-process job.

install() also watches for transformers, Lightning and accelerate being imported: their step
boundaries and run facts come from probes/frameworks.py.
"""

from __future__ import annotations

import functools

from trainprof.probes import frameworks, post_import, runtime

_installed = False


def install() -> None:
    global _installed
    if _installed or not runtime.enabled():
        return
    _installed = True
    _watch_frameworks()
    # lazy: start-up time of trainprof.session() (only wrap runs the agent)
    from trainprof.probes import elastic_agent

    elastic_agent.install()  # in the torchrun agent: how each worker ended (worker-exits.jsonl)
    post_import.when_imported("torch", lambda torch: _after_torch_import())


def _watch_frameworks() -> None:
    """Framework-native steps and facts (transformers, Lightning, accelerate) for the jobs that
    import them: probes/frameworks.py (idempotent; nothing is imported on the job's behalf)."""
    try:
        frameworks.install()
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"framework integrations not installed: {type(e).__name__}: {e}")


_hooks_installed = False


def _after_torch_import() -> None:
    """Install the activation hooks (idempotent; also used by trainprof.session())."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    try:
        from trainprof.probes import job_profiler  # lazy: start-up time of the job's bootstrap

        job_profiler.install()  # the job's own profiler, seen from its first start
        _patch_optimizer()
        _patch_distributed()
    except Exception as e:  # noqa: BLE001
        runtime.warn(f"could not install probe hooks: {type(e).__name__}: {e}")
    _watch_frameworks()  # (trainprof.session() comes here without install())


install_hooks = _after_torch_import


def _patch_optimizer() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def on_optimizer_step(optimizer, args, kwargs):
        s = runtime.active() or runtime.activate("optimizer_step")
        if s is not None:
            s.on_optimizer_step(optimizer)

    register_optimizer_step_post_hook(on_optimizer_step)


def _patch_distributed() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    if getattr(original, "_trainprof", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        runtime.activate("init_process_group")
        return result

    init_process_group._trainprof = True
    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group

    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return
    mesh_init = DeviceMesh.__init__

    @functools.wraps(mesh_init)
    def device_mesh_init(self, *args, **kwargs):
        mesh_init(self, *args, **kwargs)
        try:
            s = runtime.active() or runtime.activate("device_mesh")
            if s is not None:
                s.note_mesh(self)
        except Exception as e:  # noqa: BLE001
            runtime.warn(f"could not record the device mesh: {e}")

    DeviceMesh.__init__ = device_mesh_init
