"""`msmon report`: a self-contained HTML page of a run, built from its database."""

from __future__ import annotations

import os
import shutil
import tempfile

import click

from ..offline.results.connection import DatabaseError, connect
from ..offline.results.db import load
from ..offline.results.limits import Limits
from ..offline.results.parquet_catalog import check_sources
from ..offline.results.report_html import build
from ..offline.results.schema import SchemaError, require_msmon


@click.command("report")
@click.option(
    "-d",
    "--dir",
    "directories",
    multiple=True,
    type=click.Path(file_okay=False),
    help="A monitor output directory to load first (into --db, or a temporary database).",
)
@click.option(
    "--db",
    "database",
    type=click.Path(dir_okay=False),
    help="The database (msmon db); with -d it is brought up to date first.",
)
@click.option(
    "-o",
    "--output",
    default="msmon_report.html",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The HTML file to write.",
)
@click.option(
    "--run",
    "run",
    metavar="ID",
    help="The run to read (its id, or the start of it; `all`: every run together). Default: the newest; "
    "the others are listed.",
)
@click.option("--title", help="The page's title (default: msmon report).")
@click.option(
    "--max-steps",
    default=120,
    show_default=True,
    type=click.IntRange(min=2),
    help="Heatmap columns at most: more steps are merged.",
)
@click.option(
    "--max-rows",
    default=64,
    show_default=True,
    type=click.IntRange(min=2),
    help="Heatmap rows (tensors) at most: more tensors are merged.",
)
@click.option("--progress/--no-progress", default=None, help="Show the loading progress bar (default: on a terminal).")
def report(
    directories: tuple[str, ...],
    database: str | None,
    run: str | None,
    output: str,
    title: str | None,
    max_steps: int,
    max_rows: int,
    progress: bool | None,
) -> None:
    """Write one HTML page (no network needed to view it) with msmon analyse's verdict and the
    kind of fault at the top, the loss per rank, the anomaly timeline across ranks, per category
    and op a heatmap of tensors x steps (a click on a row: that tensor per rank over steps) with
    the top movers, the per-rank outliers of rank-local tensors, the spread of replicated
    tensors across ranks, and the monitor's cost.

    \b
    msmon report -d monitor_output -o report.html
    msmon report --db run.duckdb -o report.html
    """
    if not directories and not database:
        raise click.UsageError("give a monitor output directory (-d) or a database (--db)")
    scratch = None
    try:
        if database is None:
            scratch = tempfile.mkdtemp(prefix="msmon-report-")
            path = os.path.join(scratch, "report.duckdb")
        else:
            path = database
        if directories:
            for line in load(directories, path, progress, run=run).lines():
                click.echo(line, err=True)
        con = connect(path, read_only=True)
        try:
            require_msmon(con, database or path)
            check_sources(con)
            data = build(
                con, output, database or ", ".join(directories), Limits(max_steps=max_steps, max_rows=max_rows), title
            )
        finally:
            con.close()
    except (DatabaseError, SchemaError) as exc:
        raise click.ClickException(str(exc))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    click.echo(
        f"msmon report: {output} ({data['bytes'] / 1024:.0f} KiB, {len(data['heatmaps'])} heatmaps, "
        f"{data['anomalies']['total']} anomaly records)",
        err=True,
    )
