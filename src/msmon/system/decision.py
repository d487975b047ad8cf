"""A stop msmon decided, kept where the launcher reads it, so that the job ends like a decision and
not like a crash: `msmon run` returns the decision's exit code (system/exit_codes.py) and prints
its one line, instead of torchrun's exit code 1, its per-rank failure lines and its
ChildFailedError table.

Each rank that stops on purpose writes one record, `decisions/<host>-<pid>.json` in the job's
bootstrap directory ({"code", "line", "step", "rank", "ranks"}), atomically (a temporary file
renamed), before it leaves its training loop. Every rank of a decided stop records it (the ranks
decide together, at the same step), so each node's `msmon run` finds one even though the nodes'
bootstrap directories are apart. Without `msmon run` (the API alone, `import msmon.auto` under
plain torchrun) there is no bootstrap directory: nothing is recorded, and the rank prints the
line itself.

Several records (one per rank, or ranks that saw different things) give one decision by one
rule (`choose`): the earliest step; at the same step, the code of highest precedence in the
exit-code table (17 over 16 over 3); then the lowest rank. Torch-free: the launcher reads it.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from .environment import ENV_BOOTSTRAP_DIR
from .exit_codes import precedence

DECISIONS_DIR = "decisions"  # inside the job's bootstrap directory


@dataclass(frozen=True)
class Decision:
    """One rank's record of a stop: the exit code, the line `msmon run` prints, the step after
    which the job stopped, the rank that wrote it, and the ranks the decision names (those
    whose statistics held the fault)."""

    code: int
    line: str
    step: int
    rank: int
    ranks: list[int] = field(default_factory=list)


def record(decision: Decision, bootstrap_dir: str | None = None) -> str | None:
    """Write `decision` into the job's bootstrap directory (default: the one `msmon run` set);
    returns the file, or None without a launcher or when it cannot be written (the rank then
    says the line itself: the exit code still tells the decision)."""
    directory = bootstrap_dir or os.environ.get(ENV_BOOTSTRAP_DIR)
    if not directory or not os.path.isdir(directory):
        return None
    folder = os.path.join(directory, DECISIONS_DIR)
    path = os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.json")
    tmp = f"{path}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(decision), fh)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_decisions(bootstrap_dir: str) -> list[Decision]:
    """Every readable record of the job; a torn or foreign file is left out."""
    folder = os.path.join(bootstrap_dir, DECISIONS_DIR)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                found.append(_decision(json.load(fh)))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return found


def _decision(data: Any) -> Decision:
    if not isinstance(data, dict):
        raise ValueError("not a record")
    code, step, rank, line = data["code"], data["step"], data["rank"], data["line"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (code, step, rank)) or not isinstance(line, str):
        raise ValueError("a field of the wrong type")
    ranks = [r for r in data.get("ranks") or [] if isinstance(r, int)]
    return Decision(code, line, step, rank, ranks)


def choose(decisions: list[Decision]) -> Decision | None:
    """The job's decision among the ranks' records (the module docstring's rule), or None."""
    if not decisions:
        return None
    return min(decisions, key=lambda d: (d.step, -precedence(d.code), d.rank))
