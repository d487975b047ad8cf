"""`msmon export --to parquet`: an earlier run's CSV files as the `parquet` format's files."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import click

from ..config.schema import MonitorConfig
from ..offline.convert.sources import ConvertError, find_ranks
from ..records.parquet_layout import run_dir
from ..records.runs import ALL_RUNS, NO_RUN, RunChoiceError, choice_lines, choose_run, group_runs, runs_of

_DEFAULTS = MonitorConfig()


@click.command("export")
@click.option(
    "-d",
    "--dir",
    "directory",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="A monitor output directory ($MONITOR_OUTPUT_DIR) holding CSV files.",
)
@click.option("--to", "target", required=True, type=click.Choice(["parquet"]), help="The format to write.")
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False),
    help="The output directory the files go in, as OUT/parquet/run=<id>/ (default: DIR itself, where "
    "msmon db reads them in place of the CSV files).",
)
@click.option(
    "--run",
    "run",
    metavar="ID",
    help="The run to export (its id, or the start of it; `all`: every run). Default: the newest; the others "
    "are listed.",
)
@click.option(
    "--roll-steps",
    default=_DEFAULTS.parquet_roll_steps,
    show_default=True,
    type=click.IntRange(min=1),
    help="Steps per file (parquet_roll_steps).",
)
@click.option(
    "--roll-mb",
    default=_DEFAULTS.parquet_roll_mb,
    show_default=True,
    type=click.IntRange(min=1),
    help="A file closes past this size in MiB (parquet_roll_mb).",
)
@click.option("-j", "--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Ranks in parallel.")
def export(
    directory: str, target: str, output: str | None, run: str | None, roll_steps: int, roll_mb: int, jobs: int
) -> None:
    """Write an earlier run's CSV files as Parquet files, laid out as the `parquet` format writes
    them (OUT/parquet/run=<id>/rank_block=<b>/part-<rank>-<seq>.parquet): msmon db then reads
    them in place, and so does any engine that reads Parquet. A rank that has Parquet files in
    the run already is left as it is.

    \b
    msmon export -d monitor_output --to parquet
    msmon db -d monitor_output -o run.duckdb
    """
    try:
        from ..offline.export.csv_to_parquet import already_exported, export_rank
    except ImportError as exc:
        raise click.ClickException(f"{exc.name or 'pyarrow'} is not installed: pip install 'msmon[parquet]'")
    base = os.path.abspath(output or directory)
    try:
        jobs_list = _rank_jobs(directory, run)
    except (ConvertError, RunChoiceError) as exc:
        raise click.ClickException(str(exc))
    todo = []
    for rank_dir, rank, run_id in jobs_list:
        if already_exported(base, run_id, rank):
            click.echo(f"msmon export: rank {rank} has Parquet files in run {run_id} already; left as it is", err=True)
        else:
            todo.append((rank_dir, rank, run_id, base, roll_steps, roll_mb << 20))
    results = _export(export_rank, todo, jobs)
    values = sum(r.values for r in results)
    for problem in [p for r in results for p in r.problems][:20]:
        click.echo(f"msmon export: {problem}", err=True)
    skipped = sum(r.skipped_lines for r in results)
    if skipped:
        click.echo(f"msmon export: {skipped:,} malformed CSV lines left out", err=True)
    where = sorted({run_dir(base, run_id) for _, _, run_id, *_ in todo})
    click.echo(
        f"msmon export: {values:,} values of {len(todo)} rank directories ({sum(r.files for r in results):,} CSV "
        f"files) written as {sum(len(r.written) for r in results):,} Parquet files to {', '.join(where) or base}"
    )


def _rank_jobs(directory: str, run: str | None) -> list[tuple[str, int, str]]:
    """(rank directory, rank, run id) of every rank directory of the chosen run."""
    sources = find_ranks(directory)
    runs = group_runs({s.path: s.rank for s in sources})
    chosen, others = choose_run(runs, run)
    for line in choice_lines(chosen, others, "export"):
        click.echo(line, err=True)
    if chosen is not None:
        return [(s.path, s.rank, chosen.run_id) for s in sources if s.path in set(chosen.dirs)]
    assert run == ALL_RUNS or not runs
    # every run: a directory several runs wrote in (append_output) goes under the run that made it
    return [(s.path, s.rank, next(iter(runs_of(s.path)), (NO_RUN, ""))[0]) for s in sources]


def _export(work: Any, todo: list[tuple], jobs: int) -> list[Any]:
    if jobs <= 1 or len(todo) <= 1:
        return [work(*job) for job in todo]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(work, *zip(*todo)))
