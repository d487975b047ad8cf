"""MSMON_DEVICE_PATH=1: the CPU takes exactly the code a CUDA or NPU device takes.

msmon's statistics have CPU-only routes: the native one-pass kernel (stats.native), reads of
0-d CPU witnesses that prove a NaN/Inf count zero (reading a CPU scalar waits for nothing),
cache-sized chunks and a scratch buffer for the zero count. None of them exists on an
accelerator, so on a machine without one the accelerator's code would go untested and
unmeasured. With MSMON_DEVICE_PATH=1 every such route is off and a CPU tensor is treated as a
device tensor: the sync-free test, the op counts (benchmarks/op_counts.py) and the paired
benchmark (`MSMON_DEVICE_PATH=1 make bench`) then run the accelerator path on the CPU.
Read once per process (the monitor's first statistic); `refresh()` reads it again (tests).
"""

from __future__ import annotations

import os

import torch

ENV = "MSMON_DEVICE_PATH"
_on: bool | None = None


def refresh() -> bool:
    """Read MSMON_DEVICE_PATH from the environment now."""
    global _on
    _on = os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return _on


def on() -> bool:
    """Whether the CPU takes the accelerator path (MSMON_DEVICE_PATH=1)."""
    return refresh() if _on is None else _on


def host_code(device: torch.device) -> bool:
    """Whether tensors on `device` may take the CPU-only routes: a CPU device, and not on the
    accelerator path."""
    return device.type == "cpu" and not on()
