"""trainprof command line: one module per verb."""
import click

from trainprof import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainprof")
def main():
    """Profile and diagnose distributed PyTorch training jobs.

    \b
    Typical use:
      trainprof wrap -- torchrun --nproc-per-node 8 train.py   # capture + analyze
      trainprof analyze traces/                                # re-analyze a run directory
      trainprof demo                                           # try it on the reference workload
    """


VERBS = ("wrap", "analyze", "compare", "hang", "demo")  # trainprof.cli.<verb> defines <verb>


def _register():
    import importlib

    for verb in VERBS:
        try:
            module = importlib.import_module(f"{__name__}.{verb}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{verb}":
                continue  # verb not part of this build
            raise
        main.add_command(getattr(module, verb))


_register()
