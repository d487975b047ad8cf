"""Runs that end early on purpose: print_struct stops after the step that wrote the module tree,
and ranks outside module_ranks stop with the recording ranks (rather than hang in a collective)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # a type only: system/ sits below the collectors
    from ..collectors.structure import StructCollector


class StopAfterStruct(SystemExit):
    """Raised after print_struct wrote the module tree: a clean stop (exit code 0)."""


def stop_after_struct(
    struct: StructCollector, output_base: str, rank: int, step: int, close: Callable[[], None]
) -> None:
    """Write and print the module tree, close the monitor, stop the process (exit code 0)."""
    path = struct.write(output_base)
    if rank == 0 or not torch.distributed.is_initialized():
        print(struct.render_tree(), flush=True)
    close()
    print(
        f"msmon: module structure of rank {rank} written to {path}; stopping after step {step} as print_struct asks",
        flush=True,
    )
    raise StopAfterStruct(0)


def stop_with_the_others(rank: int, step: int, close: Callable[[], None]) -> None:
    """A rank that records nothing stops where the recording ranks stop (print_struct, cc_log_only)."""
    close()
    print(f"msmon: rank {rank} stops after step {step} with the recording ranks", flush=True)
    raise StopAfterStruct(0)
