"""msmon's exit codes, in one table: what a job that msmon ended on purpose returns, so that a
scheduler or a restart script can tell a decision from a crash. docs/launcher.md lists the same
table (a test checks the two agree). Torch-free: the launcher reads it.

A rank that stops on purpose exits with its code and records its decision where `msmon run`
reads it (system/decision.py); `msmon run` then returns the recorded code, whatever its
launcher (torchrun's 1, accelerate's, mp.spawn's) made of it. Codes 16 and 17 are reserved for
the stops that name where a fault lies (one rank's device or model copy, or every rank / the
data); the codes stay apart from the shell's 126-165 (a command not found, a signal's 128+n).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    """One of msmon's exit codes. `precedence`: when the ranks recorded different decisions
    at the same step, the highest precedence is the job's (decision.choose)."""

    code: int
    name: str
    meaning: str
    precedence: int


OK = 0
CONFIG_ERROR = 2
NONFINITE_STOP = 3
RANK_FAULT_STOP = 16
JOB_FAULT_STOP = 17

EXIT_CODES: dict[int, ExitCode] = {
    c.code: c
    for c in (
        ExitCode(OK, "ok", "the job ended normally (also `msmon struct` after the module tree, print_struct)", 0),
        ExitCode(
            CONFIG_ERROR,
            "config_error",
            "invalid config: the ranks stopped before training (a `targets` entry that names no module)",
            1,
        ),
        ExitCode(
            NONFINITE_STOP,
            "nonfinite_stop",
            'alert.on_nan: "stop": a step\'s statistics held a NaN or an inf; every rank stopped after that step',
            2,
        ),
        ExitCode(
            RANK_FAULT_STOP,
            "rank_fault_stop",
            "reserved: one rank's device or model copy is suspected; restart the job elsewhere",
            3,
        ),
        ExitCode(
            JOB_FAULT_STOP,
            "job_fault_stop",
            "reserved: every rank, or the data, turned; do not restart blindly",
            4,
        ),
    )
}


def precedence(code: int) -> int:
    """A code's precedence; an unknown code (a newer msmon's) ranks below every known one."""
    known = EXIT_CODES.get(code)
    return known.precedence if known is not None else -1
