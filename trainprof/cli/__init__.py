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


def _register():
    from trainprof.cli.analyze import analyze
    from trainprof.cli.demo import demo
    from trainprof.cli.wrap import wrap

    for cmd in (wrap, analyze, demo):
        main.add_command(cmd)


_register()
