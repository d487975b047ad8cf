"""`msmon diff`: two runs side by side, the first step and tensor where they part
(msmon.offline.diff)."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from ..offline.diff.calibrate import DEFAULT_FACTOR, run_calibrate
from ..offline.diff.command import INCOMPARABLE, DiffOptions, run_diff
from ..offline.diff.tolerance import DTYPE_EPS


@click.command("diff")
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option("--run-a", metavar="ID", help="A's run (its id or the start of it). Default: the newest.")
@click.option("--run-b", metavar="ID", help="B's run (its id or the start of it). Default: the newest.")
@click.option("--exact", is_flag=True, help="Bit equality of the stored values (deterministic jobs, CI).")
@click.option(
    "--rtol",
    type=click.FloatRange(min=0.0),
    help="Relative tolerance; never below the floor of the runs' dtype and stored digits.",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPE_EPS)),
    help="The dtype whose rounding is the floor (default: the parameters' coarsest, from summary.json).",
)
@click.option(
    "--map",
    "map_path",
    type=click.Path(dir_okay=False),
    help='A\'s names rewritten into B\'s: {"substring in A": "substring in B", ...} (msprobe style).',
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the answer as JSON.")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), help="Write the diff tables to a DuckDB file.")
@click.option(
    "--html", "html_path", type=click.Path(dir_okay=False), help="Write a page: the 20 tensors that part most."
)
@click.option("--calibrate", is_flag=True, help="INPUTS are reruns of one job: learn the tolerance (-o golden.json).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="The golden file --calibrate writes.")
@click.option("--factor", default=DEFAULT_FACTOR, show_default=True, type=click.FloatRange(min=1.0),
              help="--calibrate: the tolerance is the largest difference seen times this.")  # fmt: skip
@click.option("--run", "runs", multiple=True, metavar="ID",
              help="--calibrate: the run of each input in turn (`-` for the newest).")  # fmt: skip
@click.option("-j", "--jobs", default=0, type=click.IntRange(min=0), help="Processes reading ranks (0: up to 8).")
def diff(
    inputs: tuple[str, ...],
    run_a: str | None,
    run_b: str | None,
    exact: bool,
    rtol: float | None,
    dtype: str | None,
    map_path: str | None,
    json_path: str | None,
    db_path: str | None,
    html_path: str | None,
    calibrate: bool,
    output: str | None,
    factor: float,
    runs: tuple[str, ...],
    jobs: int,
) -> None:
    """Compare two runs' statistics over every recorded step and name the first step and tensor,
    in training order, where they part. A and B: output directories (msmon's or msprobe's
    monitor), databases from msmon db, or A a golden file from --calibrate. Exit 0: within
    tolerance; 1: parted; 2: incomparable or bad input.

    \b
    msmon diff monitor_a monitor_b                     # the default: relative, the dtype's floor
    msmon diff out out --run-a 20261206-0315 --run-b 20261206-0402 --exact
    msmon diff --calibrate rerun1 rerun2 rerun3 -o golden.json
    msmon diff golden.json new_run --json diff.json --html diff.html
    """
    if calibrate:
        if not output:
            _bad("--calibrate writes a golden file: give it with -o golden.json")
        if run_a or run_b or exact or rtol is not None or json_path or db_path or html_path or map_path:
            _bad("--calibrate takes the reruns, --run, --factor, --dtype, -j and -o only")
        sys.exit(run_calibrate(list(inputs), [None if r == "-" else r for r in runs], output, factor, jobs, dtype))
    if len(inputs) != 2:
        _bad(f"expected two inputs, A and B (got {len(inputs)}); --calibrate reads several reruns")
    if output or runs:
        _bad("-o and --run belong to --calibrate; a comparison takes --run-a, --run-b, --json, --db, --html")
    options = DiffOptions(exact, rtol, dtype, map_path, json_path, db_path, html_path, jobs)
    sys.exit(run_diff(inputs[0], inputs[1], run_a, run_b, options))


def _bad(message: str) -> NoReturn:
    click.echo(f"msmon diff: {message}", err=True)
    sys.exit(INCOMPARABLE)
