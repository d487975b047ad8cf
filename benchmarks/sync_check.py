"""Does a monitored step make the training thread wait for the device?

On CUDA: `torch.cuda.set_sync_debug_mode("error")` around the step makes any synchronising call
raise. On the CPU (the GPU script's dry run, with MSMON_DEVICE_PATH=1 so that msmon takes the
accelerator's code) a stand-in raises instead on the aten ops that read a tensor back to the
host (`.item()`, `nonzero`, ...) when a monitor's code asks for them: the training's own CPU
optimizer reads its CPU step counters, which on a GPU wait for nothing either. The same check
then runs in both modes (check_no_syncs), so the dry run keeps the GPU path from rotting.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.masked_select.default,
}


def _monitor_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("msmon", "msprobe"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        dirs.append(os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep)
    return tuple(dirs)


class HostReadsRaise(TorchDispatchMode):
    """The CPU stand-in for set_sync_debug_mode("error"): a host read asked by a monitor raises."""

    def __init__(self) -> None:
        super().__init__()
        self.dirs = _monitor_dirs()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            for frame in traceback.extract_stack():
                if os.path.abspath(frame.filename).startswith(self.dirs):
                    raise RuntimeError(f"host read {func} asked at {frame.filename}:{frame.lineno}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def syncs_raise(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with HostReadsRaise():
            yield


def check_no_syncs(tool: str, monitor, model, optimizer, batch) -> dict[str, Any]:
    """One monitored step with synchronising calls raising, around forward/backward and around
    the whole step. A sync inside a hook raises there; the monitor contains the error by
    switching that collector off, so its failure list is checked as well."""
    from workloads import lm_loss

    result: dict[str, Any] = {}
    for scope in ("forward_backward", "whole_step"):
        error = None
        try:
            with syncs_raise(batch.device):
                loss = lm_loss(model, batch)
                loss.backward()
                if scope == "whole_step":
                    optimizer.step()
            if scope == "forward_backward":
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        # the collectors a failure switched off (StepContext.failed)
        failed = sorted(getattr(getattr(monitor, "ctx", None), "failed", ())) if tool == "msmon" else []
        result[scope] = {"ok": error is None and not failed, "error": error, "collectors_switched_off": failed}
    return result
