"""Golden files: what `msmon diff --calibrate A1 A2 ...` learns from reruns of one job, and what
`msmon diff golden.json B` checks B against.

Calibration compares every pair of reruns and keeps, per category and op, the largest relative
difference seen; the tolerance is that times a factor (1.5, as Megatron's golden values take
their largest deviation), never below the floor of the runs' dtype and stored digits. The file
holds the first rerun's rows (the reference B is compared with), its facts, and both numbers per
category and op, so that it can be kept in a repository and checked anywhere.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from .cells import json_number
from .errors import DiffInputError
from .source import RunFacts, Source
from .table import NO_MICRO, Row, SideRows

FORMAT = "msmon_golden"
VERSION = 1
FACT_FIELDS = ("input", "kind", "run_id", "ranks", "storage")


def is_golden(path: str) -> bool:
    if not path.endswith(".json"):
        return False
    try:
        with open(path, "rb") as fh:
            return FORMAT.encode() in fh.read(4096)
    except OSError:
        return False


def golden_data(
    reference: SideRows,
    facts: RunFacts,
    runs: list[RunFacts],
    observed: dict[str, dict[str, float]],
    factor: float,
    floor: float,
    dtype: str,
) -> dict[str, Any]:
    ops_index: dict[tuple[str, ...], int] = {}
    rows = []
    for key in sorted(reference.rows):
        category, vpp, name, step, micro = key
        position = reference.positions.get((category, vpp, name), 0)
        for rank, (ops, values) in sorted(reference.rows[key].items()):
            index = ops_index.setdefault(ops, len(ops_index))
            rows.append([category, vpp, name, step, micro, rank, position, index, [json_number(v) for v in values]])
    return {
        FORMAT: VERSION,
        "made": datetime.now().isoformat(timespec="seconds"),
        "runs": [r.to_json() for r in runs],
        "factor": factor,
        "floor": floor,
        "dtype": dtype,
        "observed": {c: {op: json_number(v) for op, v in ops.items()} for c, ops in observed.items()},
        "tolerances": {
            c: {op: json_number(max(v * factor, floor)) for op, v in ops.items()} for c, ops in observed.items()
        },
        "reference": {
            "facts": {
                **{f: getattr(facts, f) for f in FACT_FIELDS},
                "configs": {str(k): v for k, v in facts.configs.items()},
                "jobs": {str(k): v for k, v in facts.jobs.items()},
            },
            "ops": [list(ops) for ops in ops_index],
            "rows": rows,
        },
    }


def open_golden(path: str) -> Source:
    """The reference run of a golden file as side A, with its tolerances (`golden_limits`)."""
    data = _load(path)
    try:
        ref = data["reference"]
        facts_data = ref["facts"]
        facts = RunFacts(path, "golden file")
        facts.run_id = facts_data.get("run_id")
        facts.ranks = [int(r) for r in facts_data.get("ranks", [])]
        facts.storage = list(facts_data.get("storage", []))
        facts.configs = {int(k): v for k, v in facts_data.get("configs", {}).items()}
        facts.jobs = {int(k): v for k, v in facts_data.get("jobs", {}).items()}
        facts.run_lines = [f"msmon diff: A is the reference run of {path} ({facts_data.get('input')})"]
        ops = [tuple(o) for o in ref["ops"]]
        rows = SideRows()
        for category, vpp, name, step, micro, rank, position, index, values in ref["rows"]:
            rows.add(
                Row(
                    category,
                    int(vpp),
                    name,
                    int(step),
                    int(micro if micro is not None else NO_MICRO),
                    int(rank),
                    ops[index],
                    tuple(float(v) for v in values),
                    int(position),
                )  # fmt: skip
            )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DiffInputError(
            f"{path}: not a golden file msmon diff --calibrate wrote ({type(exc).__name__}: {exc})"
        ) from None
    return Source(facts, [], rows)


def golden_limits(path: str) -> tuple[dict[str, dict[str, float]], float, str]:
    """(the tolerances per category and op, the floor, the dtype) a golden file holds."""
    data = _load(path)
    try:
        limits = {str(c): {str(op): float(v) for op, v in ops.items()} for c, ops in data["tolerances"].items()}
        return limits, float(data["floor"]), str(data.get("dtype", "float32"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DiffInputError(f"{path}: not a golden file msmon diff --calibrate wrote ({exc})") from None


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise DiffInputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise DiffInputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get(FORMAT) != VERSION:
        raise DiffInputError(f"{path}: not a golden file of this msmon (expected {FORMAT!r}: {VERSION})")
    return data
