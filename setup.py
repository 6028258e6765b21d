"""The one compiled part: the collective log's per-op hot path (probes/_fastlog.c).

Optional: where it cannot be built (no C compiler), the install goes on and the probes use the
pure-Python path of probes/collectives.py, which records the same fields at a higher cost.
Everything else is configured in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trainprof.probes._fastlog", ["probes/_fastlog.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"]),
                   Extension("trainprof.trace._kineto", ["trainprof/trace/_kineto.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"])])
