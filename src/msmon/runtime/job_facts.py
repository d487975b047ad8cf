"""What a rank's job was, in summary.json under "job": the facts two runs must share, or say
they do not, to be compared (`msmon diff` prints them as its contract): world size and
parallel layout, torch and device versions, the monitored parameters' dtypes, micro-batches
per step. Read once at attach (grad_acc_steps again when the summary is written, once it has
been counted), from what the monitor already holds: no collective, nothing per step.
"""

from __future__ import annotations

import platform
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..system.distributed import is_initialized

if TYPE_CHECKING:
    from .step_context import StepContext


def job_facts(ctx: StepContext, pp_stage: int) -> dict[str, Any]:
    """The job as this rank sees it (JSON-ready)."""
    params = [mp.param for mp in ctx.params]
    dtypes = Counter(str(p.dtype).replace("torch.", "") for p in params)
    device = params[0].device if params else torch.device("cpu")
    return {
        "world_size": dist.get_world_size() if is_initialized() else 1,
        "parallel": dict(ctx.parallel),
        "pp_stage": pp_stage,
        "optimizer_family": getattr(ctx.adapter, "family", None),
        "model": [type(m).__name__ for m in ctx.models],
        "param_dtypes": dict(sorted(dtypes.items())),
        "grad_acc_steps": ctx.grad_acc_steps,
        "device": device_facts(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "msmon": _msmon_version(),
    }


def device_facts(device: torch.device) -> dict[str, Any]:
    """The device type, its name and the runtime's version (CUDA, ROCm, CANN) where there is one."""
    facts: dict[str, Any] = {"type": device.type}
    try:
        if device.type == "cuda":
            facts["name"] = torch.cuda.get_device_name(device)
            facts["runtime"] = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
        elif device.type == "npu":
            npu = getattr(torch, "npu", None)
            facts["name"] = npu.get_device_name(device) if npu is not None else None
            facts["runtime"] = f"torch_npu {getattr(sys.modules.get('torch_npu'), '__version__', '?')}"
        else:
            facts["name"] = platform.processor() or platform.machine()
    except Exception:  # a device whose name cannot be read: the type is enough to compare
        pass
    return facts


def _msmon_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("msmon")
    except Exception:
        return None
