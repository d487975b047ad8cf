"""`msmon convert csv2tb | tb2csv`: monitor output from CSV to TensorBoard and back, per rank."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable

import click

from ..offline.convert.csv_to_tb import csv_to_tensorboard
from ..offline.convert.sources import ConvertError, default_output, find_ranks, of_run, one_per_rank
from ..offline.convert.tags import LAYOUTS
from ..offline.convert.tb_to_csv import tensorboard_to_csv


def _progress(enabled: bool) -> Callable[..., Any] | None:
    """tqdm bars on a terminal, shown once a rank takes more than a second."""
    if not enabled:
        return None
    from tqdm import tqdm

    def bar(**kwargs: Any) -> Any:
        return tqdm(delay=1.0, leave=False, file=sys.stderr, disable=None, **kwargs)

    return bar


def _ranks(directory: str, time_start: str | None, time_end: str | None, run: str | None) -> list[Any]:
    """The rank directories to convert: of the run `run` (default: the newest), in the time range."""
    try:
        sources, lines = of_run(find_ranks(directory, time_start, time_end), run, "convert")
    except (ConvertError, ValueError) as exc:
        raise click.ClickException(str(exc))
    for line in lines:
        click.echo(line, err=True)
    return sources


def _run(work: Callable[..., int], sources: list[Any], jobs: int, what: str, **kwargs: Any) -> int:
    """Convert every rank (in `jobs` processes); returns the total count `work` reports."""
    total = 0
    try:
        if jobs <= 1 or len(sources) == 1:
            progress = _progress(True)
            for source in sources:
                total += work(source, progress=progress, **kwargs)
            return total
        from tqdm import tqdm

        with (
            ProcessPoolExecutor(max_workers=jobs) as pool,
            tqdm(total=len(sources), desc=what, unit="rank", file=sys.stderr, disable=None, delay=1.0) as bar,
        ):
            futures = [pool.submit(work, source, **kwargs) for source in sources]
            for future in as_completed(futures):
                total += future.result()
                bar.update(1)
        return total
    except ConvertError as exc:
        raise click.ClickException(str(exc))


_SOURCE_OPTIONS = [
    click.option(
        "-d",
        "--dir",
        "directory",
        required=True,
        type=click.Path(exists=True, file_okay=False),
        help="A monitor output directory (all its rank directories) or one rank directory.",
    ),
    click.option(
        "-o",
        "--output",
        type=click.Path(file_okay=False),
        help="Where to write (default: DIR/<time>-csv2tensorboard or DIR/<time>-tensorboard2csv).",
    ),
    click.option("--time-start", help="Only rank directories whose time prefix is at or after this (Dec03_21-34-40)."),
    click.option("--time-end", help="Only rank directories whose time prefix is at or before this."),
    click.option(
        "--run",
        "run",
        metavar="ID",
        help="The run to convert (its id, or the start of it; `all`: every run). Default: the newest; "
        "the others are listed.",
    ),
    click.option(
        "-j",
        "--jobs",
        default=1,
        show_default=True,
        type=click.IntRange(min=1),
        help="Ranks converted in parallel processes.",
    ),
]


def _source_options(fn: Callable) -> Callable:
    for option in reversed(_SOURCE_OPTIONS):
        fn = option(fn)
    return fn


@click.group("convert")
def convert() -> None:
    """Convert monitor output between CSV and TensorBoard, rank by rank."""


@convert.command("csv2tb")
@_source_options
@click.option(
    "--tags",
    "layout",
    type=click.Choice(LAYOUTS),
    default="msmon",
    show_default=True,
    help="msmon: the live sink's tags, one events file per rank directory; by_rank: the same without "
    "the rank in the tag (tensorboard_layout by_rank: ranks overlay in one chart); msprobe: msprobe's "
    "csv2tensorboard layout (rank<r>/<category>/, tags vp<vpp>:<name>/<op>).",
)
@click.option("--category", "categories", multiple=True, help="Only these categories (repeatable), e.g. grad_reduced.")
@click.option(
    "--float32",
    is_flag=True,
    help="Write 32-bit simple values (EventAccumulator.Scalars) instead of "
    "float64 tensor scalars that keep every CSV digit.",
)
def csv2tb(
    directory: str,
    output: str | None,
    time_start: str | None,
    time_end: str | None,
    run: str | None,
    jobs: int,
    layout: str,
    categories: tuple[str, ...],
    float32: bool,
) -> None:
    """CSV files of each rank to TensorBoard events."""
    sources = _ranks(directory, time_start, time_end, run)
    if layout == "msprobe":
        try:
            one_per_rank(sources, os.path.abspath(directory))
        except ConvertError as exc:
            raise click.ClickException(str(exc))
    output = os.path.abspath(output or default_output(directory, "csv2tensorboard"))
    values = _run(
        csv_to_tensorboard,
        sources,
        jobs,
        "csv->tb",
        output=output,
        layout=layout,
        float32=float32,
        categories=list(categories) or None,
    )
    click.echo(f"msmon: {values} values of {len(sources)} rank directories written to {output}")


@convert.command("tb2csv")
@_source_options
@click.option(
    "--steps-per-file",
    type=click.IntRange(min=1),
    help="Steps per CSV file (default: the rank's step_count_per_record, else 1).",
)
@click.option("--ndigits", type=click.IntRange(min=0), help="Rounding (default: the rank's ndigits, else 6).")
def tb2csv(
    directory: str,
    output: str | None,
    time_start: str | None,
    time_end: str | None,
    run: str | None,
    jobs: int,
    steps_per_file: int | None,
    ndigits: int | None,
) -> None:
    """TensorBoard events of each rank to CSV files, as the live CSV sink writes them."""
    sources = _ranks(directory, time_start, time_end, run)
    output = os.path.abspath(output or default_output(directory, "tensorboard2csv"))
    rows = _run(
        tensorboard_to_csv, sources, jobs, "tb->csv", output=output, steps_per_file=steps_per_file, ndigits=ndigits
    )
    click.echo(f"msmon: {rows} rows of {len(sources)} rank directories written to {output}")
