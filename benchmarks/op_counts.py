"""Kernel-launching aten ops that the monitor adds to one training step, on the accelerator path.

    MSMON_DEVICE_PATH=1 MSMON_NATIVE_STATS=0 .venv/bin/python benchmarks/op_counts.py --json out.json

On an accelerator every aten op that computes something is at least one kernel launch plus its
Python dispatch (about 5-20 µs of host time each), so the number of ops the monitor adds per step
is what its host cost scales with, whatever the tensors' sizes. The count is deterministic, so it
runs on any machine: MSMON_DEVICE_PATH=1 makes the CPU take exactly the accelerator's code
(msmon.stats.device_path) and MSMON_NATIVE_STATS=0 keeps the CPU kernel out.

One step (forward, backward, optimizer step, zero_grad) of an MLP of `depth` blocks
(Linear(width, width) + ReLU each; plain torch.optim.Adam, one process) is run under a
TorchDispatchMode that counts the ops dispatched on the training thread (the writer's thread
reads host copies; its ops are not the step's). The same step of an unmonitored copy gives the
baseline; monitored minus plain is the monitor's count. Two depths (16 and 64 blocks) give the
slope: extra ops per added parameter, (ops64 - ops16) / (params64 - params16), and for all_xy
per added hooked activation tensor (rows of the actv/actv_grad categories in the step).

Kernels that run outside the dispatcher are counted too: msmon's compiled statistics pass
(msmon.stats.fused_rows, Inductor's generated code) launches kernels no TorchDispatchMode sees,
so each of its calls adds the kernels its generated code launches (fused_rows.launched_kernels);
a wrapper around several kernels counts as those kernels.

Not counted: METADATA_OPS, the ops that only make a new tensor header over existing memory (a
view, a transpose, a detach, a slice...). They launch no kernel on any device; counting them
would reward hiding work in fewer, wider views and punish code for naming a view it reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import CONFIGS, OPS  # noqa: E402

aten = torch.ops.aten

# Ops that only make a tensor header (shape, strides, offset) over existing storage, or only
# wrap an existing tensor: no kernel runs on any device.
METADATA_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "view_as",
        "alias",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "detach",
        "slice",
        "select",
        "squeeze",
        "unsqueeze",
        "_reshape_alias",
        "reshape",  # of a contiguous tensor; a copying reshape dispatches `clone`/`_unsafe_view` too
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "lift_fresh",
        "view_as_real",
        "_indices",
        "_values",
        "unflatten",
        "flatten",  # a view of a contiguous tensor (otherwise `clone` is dispatched and counted)
        "set_",
        "prim::device",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
    }
)

# beyond workloads.CONFIGS: Adam's update and ratio (with their per-parameter histograms)
EXTRA_CONFIGS: dict[str, dict[str, Any]] = {"ur": {"ur_distribution": True}}
ALL_CONFIGS = {**CONFIGS, **EXTRA_CONFIGS}

WIDTH = 256
BATCH = 8
DEPTHS = (16, 64)
WARMUP_STEPS = 3  # Adam's state, the monitor's caches and the first step's rules settle first


def op_name(func: Any) -> str:
    """The aten op's base name: `aten.view.default` -> `view`."""
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", str(func)).split(".")[-1]


class KernelOps(TorchDispatchMode):
    """Counts the ops that launch a kernel, on the thread that entered the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.count = 0
        self.by_name: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if threading.get_ident() == self.thread:
            name = op_name(func)
            if name not in METADATA_OPS:
                self.count += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def mlp(depth: int, width: int = WIDTH) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    for _ in range(depth):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class StepCount:
    ops: int  # kernel-launching ops of one step, on the training thread
    params: int  # parameter tensors of the model
    hooked: int  # activation rows (actv, actv_grad) the monitor recorded in that step
    by_name: dict[str, int]


class _ActivationRows:
    """How many activation rows the monitor's buffer handed over per step (read off `take`)."""

    def __init__(self) -> None:
        self.last = 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        from msmon.runtime.buffer import StepBuffer

        original = StepBuffer.take

        def take(buffer):
            taken = original(buffer)
            self.last = sum(1 for key in taken[0] if key.category in ("actv", "actv_grad"))
            return taken

        StepBuffer.take = take  # type: ignore[method-assign]
        try:
            yield
        finally:
            StepBuffer.take = original  # type: ignore[method-assign]


def count_step(depth: int, config: str | None, width: int = WIDTH, workdir: str | None = None) -> StepCount:
    """The ops of one steady-state step of a `depth`-block MLP, monitored with `config`
    (a name in ALL_CONFIGS) or plain (None)."""
    torch.manual_seed(0)
    model = mlp(depth, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, width)
    rows = _ActivationRows()
    monitor = None
    with contextlib.ExitStack() as stack:
        if config is not None:
            from msmon import TrainerMon

            directory = workdir or stack.enter_context(tempfile.TemporaryDirectory())
            path = os.path.join(directory, f"{config}-{depth}.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"format": "csv", "ops": list(OPS), **ALL_CONFIGS[config]}, fh)
            stack.enter_context(_output_dir(os.path.join(directory, f"out-{config}-{depth}")))
            stack.enter_context(rows.watching())
            monitor = TrainerMon(path, params_have_main_grad=False)
            monitor.set_monitor(model, optimizer)
        for _ in range(WARMUP_STEPS):
            _step(model, optimizer, x)
        from msmon.stats import fused_rows

        compiled_before = fused_rows.launched_kernels()
        with KernelOps() as mode:
            _step(model, optimizer, x)
        compiled = fused_rows.launched_kernels() - compiled_before
        if compiled:
            mode.count += compiled
            mode.by_name["<compiled statistics kernel>"] = compiled
        if monitor is not None:
            monitor.close()
    params = sum(1 for _ in model.parameters())
    return StepCount(mode.count, params, rows.last, dict(sorted(mode.by_name.items())))


@contextlib.contextmanager
def _output_dir(path: str) -> Iterator[None]:
    old = os.environ.get("MONITOR_OUTPUT_DIR")
    os.environ["MONITOR_OUTPUT_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = old


@dataclass(frozen=True)
class Slope:
    config: str
    extra_ops: dict[int, int]  # depth -> monitored minus plain
    params: dict[int, int]
    hooked: dict[int, int]
    per_param: float  # (extra64 - extra16) / (params64 - params16)
    per_hooked: float | None  # the same per hooked activation row, where any are recorded
    added_by_name: dict[str, int]  # at the largest depth: monitored minus plain, per op


def slope(config: str, depths: tuple[int, int] = DEPTHS, width: int = WIDTH) -> Slope:
    """The monitor's extra ops per added parameter (and hooked activation) for one config."""
    extra: dict[int, int] = {}
    params: dict[int, int] = {}
    hooked: dict[int, int] = {}
    added: dict[str, int] = {}
    for depth in depths:
        plain = count_step(depth, None, width)
        monitored = count_step(depth, config, width)
        extra[depth] = monitored.ops - plain.ops
        params[depth] = monitored.params
        hooked[depth] = monitored.hooked
        names = set(plain.by_name) | set(monitored.by_name)
        added = {n: monitored.by_name.get(n, 0) - plain.by_name.get(n, 0) for n in sorted(names)}
        added = {n: v for n, v in added.items() if v}
    low, high = depths
    per_param = (extra[high] - extra[low]) / (params[high] - params[low])
    per_hooked = (extra[high] - extra[low]) / (hooked[high] - hooked[low]) if hooked[high] != hooked[low] else None
    return Slope(config, extra, params, hooked, per_param, per_hooked, added)


@contextlib.contextmanager
def accelerator_path() -> Iterator[None]:
    """MSMON_DEVICE_PATH=1 and MSMON_NATIVE_STATS=0 for this process while inside."""
    from msmon.stats import device_path, native

    saved = {name: os.environ.get(name) for name in (device_path.ENV, native.ENV)}
    os.environ[device_path.ENV] = "1"
    os.environ[native.ENV] = "0"
    device_path.refresh()
    native.reset()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        device_path.refresh()
        native.reset()


TARGET_CONFIGS = ("wg", "wg+mv+param", "all_xy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(TARGET_CONFIGS), choices=list(ALL_CONFIGS))
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--default-path", action="store_true", help="measure the default install (no switch)")
    parser.add_argument("--by-name", action="store_true", help="print the added ops per aten op")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    context = contextlib.nullcontext() if args.default_path else accelerator_path()
    results = []
    with context:
        for config in args.configs:
            s = slope(config, DEPTHS, args.width)
            results.append(s)
            hooked = f", {s.per_hooked:.2f} per hooked activation" if s.per_hooked is not None else ""
            print(
                f"{config:12s} extra ops {s.extra_ops[DEPTHS[0]]} ({DEPTHS[0]} blocks) / {s.extra_ops[DEPTHS[1]]} "
                f"({DEPTHS[1]} blocks): {s.per_param:.2f} per added parameter{hooked}",
                flush=True,
            )
            if args.by_name:
                print("   ", s.added_by_name)
    if args.json:
        path = "default" if args.default_path else "accelerator (MSMON_DEVICE_PATH=1, MSMON_NATIVE_STATS=0)"
        payload = {
            "path": path,
            "width": args.width,
            "depths": list(DEPTHS),
            "torch": torch.__version__,
            "results": [asdict(s) for s in results],
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1)


if __name__ == "__main__":
    main()
