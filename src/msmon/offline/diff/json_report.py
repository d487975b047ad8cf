"""`--json FILE`: the whole answer, `first_divergence` (null when none) and the front included."""

from __future__ import annotations

import json
import os
from typing import Any

from .outcome import Outcome


def to_json(outcome: Outcome) -> dict[str, Any]:
    f = outcome.findings
    first = outcome.first
    return {
        "a": outcome.a.to_json(),
        "b": outcome.b.to_json(),
        "contract": outcome.contract.to_json(),
        "layout": {"same": outcome.layout.same, "why": outcome.layout.why},
        "comparison": outcome.categories,
        "tolerance": outcome.tolerance.to_json(),
        "compared": {
            "steps": len(f.steps),
            "tensors": len(f.tensors),
            "rows": f.rows,
            "values": f.values,
            "rows_only_in_a": dict(f.only_a),
            "rows_only_in_b": dict(f.only_b),
            "files_identical": outcome.identical_files,
        },
        "identical": f.identical and first is None,
        "verdict": outcome.verdict(),
        "first_divergence": first.to_json() if first is not None else None,
        "interpretation": outcome.interpretation,
        "front": outcome.front(),
        "top": [c.to_json() for c in outcome.top],
        "exit_code": outcome.exit_code(),
    }


def write_json(outcome: Outcome, path: str) -> None:
    write_atomically(path, to_json(outcome))


def write_atomically(path: str, data: Any) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)
