# Loaded by every Python process started under `trainprof wrap` (this folder is put first on
# PYTHONPATH). It activates trainprof's probes lazily, then hands over to any other
# sitecustomize further down sys.path so the job's environment behaves as without us.
import os
import sys


def _trainprof_bootstrap():
    # TRAINPROF_DISABLE: 0/false/no/off (or empty) leave the probes on (trainprof.settings)
    off = os.environ.get("TRAINPROF_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")
    if not os.environ.get("TRAINPROF_RUN_DIR") or off:
        return
    if not _same_trainprof():
        return
    try:
        # lazy: start-up time of the job's bootstrap (only when the probes are on)
        from trainprof.probes.bootstrap import install

        install()
    except Exception as e:  # noqa: BLE001 - never stop the job
        sys.stderr.write(f"trainprof: probes not installed in pid {os.getpid()}: {e}\n")


def _same_trainprof():
    """False (said once on stderr) when this Python cannot import trainprof, or imports another
    copy than the `trainprof wrap` this folder belongs to: its probes would not be the ones the
    launcher and the analysis expect. Nothing is imported to find out."""
    import importlib.util

    ours = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        spec = importlib.util.find_spec("trainprof")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        sys.stderr.write(f"trainprof: probes not installed in pid {os.getpid()}: this Python "
                         f"({sys.executable}) cannot import trainprof; `trainprof wrap` is "
                         f"{ours}: run the job with the Python it is installed in\n")
        return False
    where = [os.path.realpath(p) for p in (spec.submodule_search_locations or [])]
    if where and ours not in where and _version(where[0]) != _version(ours):
        sys.stderr.write(f"trainprof: probes not installed in pid {os.getpid()}: this Python "
                         f"({sys.executable}) imports trainprof {_version(where[0])} from "
                         f"{where[0]}, but `trainprof wrap` is {_version(ours)} from {ours}: run "
                         f"the job with the Python trainprof wrap is installed in (python -m "
                         f"torch.distributed.run instead of torchrun), or install the same "
                         f"version there\n")
        return False
    return True


def _version(package_dir):
    """__version__ of the trainprof package in ``package_dir``, read from its __init__.py's text
    (importing it would run it); None when unreadable. Another copy of the same version (pipx
    for the CLI, the job's environment for the probes) is the same trainprof."""
    import re

    try:
        with open(os.path.join(package_dir, "__init__.py"), encoding="utf-8") as f:
            m = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", f.read(1 << 16), re.M)
    except (OSError, UnicodeDecodeError):
        return None
    return m.group(1) if m else None


def _chain_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery
    import importlib.util

    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == here:
        return
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"trainprof: the job's own sitecustomize failed: {e}\n")


_trainprof_bootstrap()
_chain_next_sitecustomize()
