"""trainprof command line: one module per verb, imported only when that verb runs.

Start-up cost matters (`trainprof analyze trace.json` on a small trace is mostly start-up): this
module imports click and nothing of trainprof's own; `trainprof analyze` never imports the
launcher, `trainprof wrap` never imports the analysis (tests/unit/trainprof/test_startup.py guards it).
"""
import importlib

import click

from trainprof import __version__

VERBS = ("wrap", "analyze", "compare", "hang", "demo")  # trainprof.cli.<verb> defines <verb>


class _Verbs(click.Group):
    """A group whose verbs are the modules trainprof.cli.<verb>, imported on first use. A verb
    whose module is not part of this build is left out."""

    def list_commands(self, ctx):
        return sorted(v for v in VERBS if self.get_command(ctx, v) is not None)

    def get_command(self, ctx, name):
        cmd = self.commands.get(name)
        if cmd is not None or name not in VERBS:
            return cmd
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{name}":
                return None  # verb not part of this build
            raise
        cmd = getattr(module, name)
        self.add_command(cmd, name)
        return cmd


@click.group(cls=_Verbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainprof")
def main():
    """Profile and diagnose distributed PyTorch training jobs.

    \b
    Typical use:
      trainprof wrap -- torchrun --nproc-per-node 8 train.py   # capture + analyze
      trainprof analyze traces/                                # re-analyze a run directory
      trainprof demo                                           # try it on the reference workload
    """
