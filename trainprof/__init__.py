"""trainprof: profiling and diagnostics for distributed PyTorch training.

The user-facing Python API lives in :mod:`trainprof.probes.api`; the most common calls are
re-exported here lazily so that ``import trainprof`` stays cheap and never imports torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "step", "session", "set_run_info"]


def __getattr__(name):
    if name in ("step", "session", "set_run_info"):
        from trainprof.probes import api  # lazy: start-up time of import trainprof

        return getattr(api, name)
    raise AttributeError(f"module 'trainprof' has no attribute {name!r}")
