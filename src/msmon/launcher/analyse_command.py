"""`msmon analyse`: order the anomalies of every rank in time and print the first ones."""

from __future__ import annotations

import sys

import click

from ..offline.analyse.command import run_analyse


class _SeveralSteps(click.Command):
    """`-s 3 4 5`: one option followed by several steps, as msprobe writes it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        expanded: list[str] = []
        pending = False  # an -s whose first value has not come yet
        in_steps = False
        for arg in args:
            if arg in ("-s", "--steps"):
                pending = in_steps = True
            elif in_steps and _is_int(arg):
                expanded += ["-s", arg]
                pending = False
            else:
                if pending:
                    expanded.append("-s")  # click then reports the bad or missing value
                pending = in_steps = False
                expanded.append(arg)
        if pending:
            expanded.append("-s")
        return super().parse_args(ctx, expanded)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


@click.command("analyse", cls=_SeveralSteps)
@click.option(
    "-d",
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False),
    help="The anomaly_detected directory of a run.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="A directory, or the .json file for msmon's report (default: DIR/msmon_analyse.json); "
    "msprobe's anomaly_analyse.json is written beside it.",
)
@click.option(
    "-k",
    "--top-k",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many of the first anomalies to print.",
)
@click.option("-s", "--steps", type=int, multiple=True, help="Only these steps: -s 3 4 5.")
@click.option(
    "--run",
    "run",
    metavar="ID",
    help="The run whose records to read (its id, or the start of it; `all`: every run). Default: the newest.",
)
def analyse(directory: str, output: str | None, top_k: int, steps: tuple[int, ...], run: str | None) -> None:
    """Order the anomalies of every rank in time and print the first ones."""
    sys.exit(run_analyse(directory, output, top_k, list(steps) or None, run))
