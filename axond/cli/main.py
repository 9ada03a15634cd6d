"""The `axond` console script: one click group, one module per command."""

from __future__ import annotations

import click

from axond import __version__
from axond.cli.common import EXIT_CODES_HELP, examples
from axond.cli.coordinator_cmd import coordinator
from axond.cli.run_cmd import run
from axond.cli.slurm_cmd import slurm
from axond.cli.status_cmd import health, status
from axond.cli.timeline_cmd import timeline
from axond.cli.worker_cmd import worker


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=examples("axond worker --standalone --nproc-per-node 2 -- python train.py",
                    "axond coordinator --host 127.0.0.1 &   # this machine only (--host 0.0.0.0 for others)",
                    "axond worker --coordinator 127.0.0.1:29500 -- python train.py",
                    "axond COMMAND --help               # each command's options and examples")
    + EXIT_CODES_HELP + " See docs/cli.md.",
)
@click.version_option(__version__, prog_name="axond")
def main() -> None:
    """axond: distributed-training runtime (coordinator, workers, jobs)."""


main.add_command(coordinator)
main.add_command(worker)
main.add_command(run)
main.add_command(status)
main.add_command(health)
main.add_command(timeline)
main.add_command(slurm)
