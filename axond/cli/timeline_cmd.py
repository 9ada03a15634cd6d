"""`axond timeline merge DIR -o OUT`: one trace of every rank's timeline file, on one clock."""

from __future__ import annotations

import click

from axond.cli.common import EXIT_FAILED, examples, fail
from axond.observe.merge import TimelineError, write_merged


_EXAMPLES = (
    "AXOND_TIMELINE=trace axond worker --standalone --nproc-per-node 2 -- python train.py",
    "axond timeline merge trace -o timeline.json      # then open timeline.json in ui.perfetto.dev",
)


@click.group("timeline", short_help="Work with the per-rank timelines written under AXOND_TIMELINE.",
             epilog=examples(*_EXAMPLES) + "See docs/timeline.md.")
def timeline() -> None:
    """Per-rank timelines: run a job with AXOND_TIMELINE=DIR, then merge DIR into one trace that Perfetto
    (ui.perfetto.dev) or chrome://tracing opens."""


@timeline.command("merge", epilog=examples(*_EXAMPLES) + "Exit codes: 0 merged; 1 nothing to merge or a file "
                  "it cannot read or write (the message says which); 2 usage error.")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("-o", "--output", default="timeline.json", show_default=True, type=click.Path(dir_okay=False),
              help="The merged trace (Chrome trace JSON).")
def merge_cmd(directory: str, output: str) -> None:
    """Join the rank files in DIRECTORY (rank-*.json) on one clock into OUTPUT."""
    try:
        files, events = write_merged(directory, output)
    except (TimelineError, OSError) as e:
        fail("timeline", str(e), EXIT_FAILED)
    click.echo(f"axond timeline: merged {files} rank file(s), {events} events, into {output}", err=True)
