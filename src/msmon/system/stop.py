"""Runs that end early on purpose: print_struct stops after the step that wrote the module tree,
ranks outside module_ranks stop with the recording ranks (rather than hang in a collective), and
`alert.on_nan: "stop"` ends the job after a step with a NaN or an inf, and alert.actions' stop with
the exit code of the kind of fault (runtime/actions/)."""

from __future__ import annotations

import os
from typing import Callable, Protocol

import torch

from .decision import Decision, record
from .environment import ENV_BOOTSTRAP_DIR, ENV_JOB_MODE
from .exit_codes import NONFINITE_STOP


class ModuleTree(Protocol):
    """The module tree print_struct writes (collectors/structure.py's collector: system/ sits below
    the collectors, so it names it by this protocol)."""

    enabled: bool

    def write(self, base_dir: str) -> str: ...

    def render_tree(self) -> str: ...


class StopRun(SystemExit):
    """A stop msmon asks for after a step: it passes through the step's own error handling."""


class StopAfterStruct(StopRun):
    """Raised after print_struct wrote the module tree: a clean stop (exit code 0)."""


class StopOnNan(StopRun):
    """Raised on every monitored rank after the step in which one of them met a NaN or an inf,
    under `alert.on_nan: "stop"`: the job fails (exit code NAN_EXIT_CODE)."""


NAN_EXIT_CODE = NONFINITE_STOP


def stop_after_struct(struct: ModuleTree, output_base: str, rank: int, step: int, close: Callable[[], None]) -> None:
    """Write and print the module tree, close the monitor, stop the process (exit code 0)."""
    path = struct.write(output_base)
    if rank == 0 or not torch.distributed.is_initialized():
        print(struct.render_tree(), flush=True)
    close()
    if os.environ.get(ENV_JOB_MODE) != "struct":  # `msmon struct`'s launcher says where each tree lands
        where = "" if os.environ.get(ENV_BOOTSTRAP_DIR) else f" to {path}"
        print(
            f"msmon: module structure of rank {rank} written{where}; stopping after step {step} as print_struct asks",
            flush=True,
        )
    raise StopAfterStruct(0)


def stop_with_the_others(rank: int, step: int, close: Callable[[], None]) -> None:
    """A rank that records nothing stops where the recording ranks stop (print_struct, cc_log_only)."""
    close()
    print(f"msmon: rank {rank} stops after step {step} with the recording ranks", flush=True)
    raise StopAfterStruct(0)


def stop_on_nan(
    rank: int, step: int, ranks: list[int], close: Callable[[], None], all_closed: Callable[[], None]
) -> None:
    """Close the monitor (pending steps, the anomaly dump, summary.json written), record the
    decision for the launcher (system/decision.py), wait for the other ranks to have closed
    theirs and recorded it too (`all_closed`), stop the process with NAN_EXIT_CODE. Under `msmon
    run` the launcher prints the decision's line once for the job; without it each rank says it."""
    close()
    line = (
        f"msmon: the job stopped after step {step} as alert.on_nan asks: non-finite statistics on "
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (exit code {NAN_EXIT_CODE}); "
        "the output and the anomaly dump are complete"
    )
    recorded = record(Decision(NAN_EXIT_CODE, line, step, rank, sorted(ranks)))
    all_closed()
    if recorded is None:
        print(line.replace("msmon:", f"msmon[rank {rank}]:", 1), flush=True)
    raise StopOnNan(NAN_EXIT_CODE)


class StopOnAction(StopRun):
    """Raised on every monitored rank at the step boundary where the ranks decided a stop action
    of alert.actions (runtime/actions/stop.py): the exit code says the kind of fault."""
