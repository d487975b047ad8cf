"""`msmon diff A B` itself: open both sides, decide how to compare them, read, compare, and
hand the answer to the outputs. Exit codes for CI: 0 within tolerance, 1 parted, 2 incomparable
or bad input (one line, never a traceback)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from . import parquet_rows
from .compare import compare
from .contract import check_same_model, contract
from .directory_source import files_of
from .duckdb_table import write_database
from .errors import DiffInputError, Incomparable
from .findings import Findings
from .golden import golden_limits
from .html_page import write_page
from .inputs import open_input
from .interpret import interpret
from .json_report import write_json
from .layout import Layout, decide
from .names import load_map
from .outcome import Outcome
from .reading import ReadPair, default_jobs, read_pair, rows_of
from .series import series
from .source import CSV, PARQUET, RANK_DIR, Source
from .table import SideRows, TensorKey
from .terminal import lines
from .tolerance import DEFAULT_NDIGITS, DTYPE_EPS, Calibrated, Exact, Relative, Tolerance, dtype_of, storage_floor

INCOMPARABLE = 2
TOP = 20


@dataclass
class DiffOptions:
    """The command line's choices: the tolerance mode, --dtype, --map, the outputs, -j."""

    exact: bool = False
    rtol: float | None = None
    dtype: str | None = None
    map_path: str | None = None
    json_path: str | None = None
    db_path: str | None = None
    html_path: str | None = None
    jobs: int = 0  # 0: as many as the machine has (at most 8)


def run_diff(a_path: str, b_path: str, run_a: str | None, run_b: str | None, options: DiffOptions) -> int:
    try:
        outcome = diff(a_path, b_path, run_a, run_b, options)
        for line in lines(outcome):
            print(line)
        if options.json_path:
            write_json(outcome, options.json_path)
            print(f"msmon diff: {options.json_path} written", file=sys.stderr)
        if options.db_path:
            rows = write_database(outcome, options.db_path)
            print(f"msmon diff: {options.db_path} written (table diff: {rows:,} values that differ)", file=sys.stderr)
        if options.html_path:
            write_page(outcome, options.html_path)
            print(f"msmon diff: {options.html_path} written", file=sys.stderr)
    except (DiffInputError, Incomparable) as exc:
        print(f"msmon diff: {exc}", file=sys.stderr)
        return INCOMPARABLE
    except OSError as exc:
        print(f"msmon diff: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return INCOMPARABLE
    return outcome.exit_code()


def diff(a_path: str, b_path: str, run_a: str | None, run_b: str | None, options: DiffOptions) -> Outcome:
    names = load_map(options.map_path)
    a, b = open_input(a_path, run_a), open_input(b_path, run_b)
    if b.facts.kind == "golden file":
        raise DiffInputError(f"{b_path}: a golden file is the first input (msmon diff golden.json B)")
    tolerance = choose_tolerance(options, a, b)
    layout = decide(a.facts, b.facts)
    pair = read_pair(a, b, layout.same and not names, names, options.jobs or default_jobs())
    layout.micro_a = pair.a.micro_steps_per_step() or _grad_acc(a)
    layout.micro_b = pair.b.micro_steps_per_step() or _grad_acc(b)
    tensors_a, tensors_b = pair.a.tensors | pair.counted.tensors, pair.b.tensors | pair.counted.tensors
    check_same_model(tensors_a, tensors_b)
    findings = Findings(
        tolerance,
        position=lambda t: pair.a.positions.get(t, pair.b.positions.get(t, 0)),
        pp_stage=lambda rank: int(a.facts.jobs.get(rank if rank is not None else -1, {}).get("pp_stage") or 0),
        keep_differing=bool(options.db_path),
    )
    findings.add_counted(pair.counted)
    compare(pair.a, pair.b, layout, findings)
    categories = sorted({t[0] for t in tensors_a & tensors_b})
    outcome = Outcome(
        a.facts,
        b.facts,
        contract(a.facts, b.facts, tensors_a, tensors_b),
        layout,
        tolerance,
        findings,
        {c: layout.describe(c) for c in categories},
        _interpretation(findings, pair.a),
        identical_files=pair.identical_files,
        parsed_chunks=pair.parsed_chunks,
    )
    outcome.top = findings.top(TOP)
    if options.html_path and outcome.top:
        full_a, full_b = _complete(outcome, pair, a, b, layout)
        outcome.series = [series(cell, full_a, full_b) for cell in outcome.top]
    return outcome


def choose_tolerance(options: DiffOptions, a: Source, b: Source) -> Tolerance:
    """The mode asked for; by default relative with the floor of the runs' dtype and stored digits."""
    jobs = list(a.facts.jobs.values()) + list(b.facts.jobs.values())
    dtype = options.dtype or dtype_of([d for job in jobs for d in (job.get("param_dtypes") or {})])
    digits = [c.get("ndigits") for c in list(a.facts.configs.values()) + list(b.facts.configs.values())]
    ndigits = min([d for d in digits if isinstance(d, int)] or [DEFAULT_NDIGITS])
    floor = max(DTYPE_EPS[dtype], storage_floor(a.facts.storage, ndigits), storage_floor(b.facts.storage, ndigits))
    if a.facts.kind == "golden file":
        if options.exact or options.rtol is not None:
            raise DiffInputError("a golden file brings its own tolerances: leave out --exact and --rtol")
        limits, golden_floor, golden_dtype = golden_limits(a.facts.input)
        return Calibrated(limits, max(floor, golden_floor), options.dtype or golden_dtype, a.facts.input)
    if options.exact and options.rtol is not None:
        raise DiffInputError("--exact and --rtol: choose one")
    if options.exact:
        return Exact(floor, dtype)
    if options.rtol is not None:
        return Relative(options.rtol, floor, dtype)
    return Relative(0.0, floor, dtype, default=True)


def _grad_acc(source: Source) -> int | None:
    jobs = source.facts.jobs
    value = jobs[min(jobs)].get("grad_acc_steps") if jobs else None
    return value if isinstance(value, int) else None


def _interpretation(findings: Findings, side_a: SideRows) -> str | None:
    first = findings.first
    if first is None:
        return None
    actv = [p for (c, _, _), p in side_a.positions.items() if c == "actv"]
    tensor: TensorKey = (first.category, first.vpp_stage, first.name)
    first_module = first.category == "actv" and side_a.positions.get(tensor) == min(actv, default=-1)
    return interpret(first, findings.front.get(first.step, {}), min(findings.steps, default=first.step), first_module)


def _complete(outcome: Outcome, pair: ReadPair, a: Source, b: Source, layout: Layout) -> tuple[SideRows, SideRows]:
    """Both sides' rows of the charted tensors at every step: files skipped as identical are read
    again for the ranks and categories the charts need (Parquet rows counted in the join too)."""
    if not pair.counted.rows:
        return pair.a, pair.b
    wanted = {(c.rank, c.category) for c in outcome.top} | {(c.a_rank, c.category) for c in outcome.top}
    sides = []
    for source, rows in ((a, pair.a), (b, pair.b)):
        full = SideRows()
        full.merge(rows)
        for chunk in source.chunks:
            if chunk.kind == PARQUET:
                categories = {c for r, c in wanted if r == chunk.rank}
                for row in parquet_rows.rows(chunk.files, chunk.rank or 0, categories, chunk.ops) if categories else []:
                    full.add(row)
                continue
            files = files_of(chunk) if chunk.kind == RANK_DIR else [chunk]
            for file in files:
                if file.kind == CSV and (file.rank, file.category) in wanted:
                    for row in rows_of(file):
                        full.add(row)
        sides.append(full)
    return sides[0], sides[1]
