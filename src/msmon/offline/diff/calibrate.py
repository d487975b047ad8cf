"""`msmon diff --calibrate A1 A2 A3 ... -o golden.json`: the tolerance learnt from reruns of one
job (golden.py says what the file holds). Every pair of reruns is compared as `msmon diff`
compares two runs; per category and op the largest relative difference is kept."""

from __future__ import annotations

import sys
from itertools import combinations

from .command import INCOMPARABLE, DiffOptions, choose_tolerance
from .compare import compare
from .contract import check_same_model
from .errors import DiffInputError, Incomparable
from .findings import Findings
from .golden import golden_data
from .inputs import open_input
from .json_report import write_atomically
from .layout import decide
from .names import NameMap
from .reading import default_jobs, read_pair
from .source import Source
from .table import SideRows
from .tolerance import Tolerance

DEFAULT_FACTOR = 1.5


class Observing(Tolerance):
    """A tolerance that passes everything and remembers the largest difference per category and op."""

    mode = "observing"

    def __init__(self, floor: float, dtype: str) -> None:
        super().__init__(floor, dtype)
        self.observed: dict[str, dict[str, float]] = {}

    def limit(self, category: str, op: str) -> float:
        return float("inf")

    def over(self, category: str, op: str, a: float, b: float, relative: float) -> bool:
        ops = self.observed.setdefault(category, {})
        ops[op] = max(ops.get(op, 0.0), relative)
        return False

    def describe(self) -> str:
        return "observing"


def run_calibrate(
    paths: list[str], runs: list[str | None], output: str, factor: float, jobs: int = 0, dtype: str | None = None
) -> int:
    try:
        if len(paths) < 2:
            raise DiffInputError("--calibrate needs two reruns of the job at least (three are better)")
        if len(runs) > len(paths):
            raise DiffInputError(f"{len(runs)} --run options for {len(paths)} inputs")
        sources = [open_input(p, r) for p, r in zip(paths, runs + [None] * (len(paths) - len(runs)))]
        if any(s.facts.kind == "golden file" for s in sources):
            raise DiffInputError("--calibrate reads reruns of the job, not a golden file")
        rows = [_read_whole(s, jobs) for s in sources]
        floor_tol = choose_tolerance(DiffOptions(dtype=dtype), sources[0], sources[-1])
        observing = Observing(floor_tol.floor, floor_tol.dtype)
        for ops_category in _ops(rows[0]).items():
            observing.observed.setdefault(ops_category[0], {op: 0.0 for op in ops_category[1]})
        for i, j in combinations(range(len(sources)), 2):
            check_same_model(rows[i].tensors, rows[j].tensors)
            findings = Findings(observing, position=lambda t: 0, pp_stage=lambda r: 0)
            compare(rows[i], rows[j], decide(sources[i].facts, sources[j].facts), findings)
        data = golden_data(
            rows[0], sources[0].facts, [s.facts for s in sources], observing.observed, factor, floor_tol.floor,
            floor_tol.dtype,
        )  # fmt: skip
        write_atomically(output, data)
    except (DiffInputError, Incomparable) as exc:
        print(f"msmon diff: {exc}", file=sys.stderr)
        return INCOMPARABLE
    except OSError as exc:
        print(f"msmon diff: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return INCOMPARABLE
    for source in sources:
        print(f"rerun: {source.facts.describe()}")
    print(f"tolerance per category (the largest relative difference among {len(sources)} reruns x {factor:g}, "
          f"floor {floor_tol.floor:.2g} for {floor_tol.dtype} and stored digits):")  # fmt: skip
    for category, ops in sorted(observing.observed.items()):
        largest = max(ops.values(), default=0.0)
        print(f"  {category}: largest {largest:.3g} -> up to {max(largest * factor, floor_tol.floor):.3g}")
    if all(v == 0.0 for ops in observing.observed.values() for v in ops.values()):
        print("the reruns are identical bit for bit: the tolerance is the floor (--exact checks bit equality)")
    print(f"msmon diff: {output} written ({len(data['reference']['rows']):,} reference rows)", file=sys.stderr)
    return 0


def _read_whole(source: Source, jobs: int) -> SideRows:
    """Every row of one side (a golden file's reference is the first rerun, read whole)."""
    empty = Source(source.facts)
    return read_pair(source, empty, False, NameMap(), jobs or default_jobs()).a


def _ops(rows: SideRows) -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for key, by_rank in rows.rows.items():
        for ops, _ in by_rank.values():
            found.setdefault(key[0], ops)
    return found
