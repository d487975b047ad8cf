"""`msmon db`: every rank's output of a run in one DuckDB database (msmon.offline.results.db)."""

from __future__ import annotations

import click

from ..offline.results.connection import DatabaseError
from ..offline.results.db import load
from ..offline.results.schema import SchemaError


@click.command("db")
@click.option(
    "-d",
    "--dir",
    "directories",
    required=True,
    multiple=True,
    type=click.Path(file_okay=False),
    help="A monitor output directory ($MONITOR_OUTPUT_DIR); repeat for several (nodes copied apart).",
)
@click.option(
    "-o",
    "--output",
    default="msmon.duckdb",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The database file; an existing one is brought up to date (only new data is added).",
)
@click.option(
    "--run",
    "run",
    metavar="ID",
    help="The run to read (its id, or the start of it; `all`: every run together). Default: the newest; "
    "the others are listed.",
)
@click.option("--progress/--no-progress", default=None, help="Show a progress bar (default: on a terminal).")
def db(directories: tuple[str, ...], output: str, run: str | None, progress: bool | None) -> None:
    """Load every rank's CSV and TensorBoard output, anomaly dumps, summaries and configs into
    one DuckDB database, and catalog its Parquet files (read in place by the `metrics` view,
    never copied). Run it again as the job writes more: unchanged files are skipped and a
    grown CSV file adds only its new rows. A database holds one run (`msmon run` gives each job
    a run id): the newest, unless --run names another.

    \b
    msmon db -d monitor_output -o run.duckdb
    python -c "import duckdb; print(duckdb.connect('run.duckdb').sql('SELECT * FROM monitor_cost'))"
    """
    try:
        report = load(directories, output, progress, run=run)
    except (DatabaseError, SchemaError) as exc:
        raise click.ClickException(str(exc))
    for line in report.lines():
        click.echo(line, err=True)
