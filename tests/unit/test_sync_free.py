"""The monitor reads nothing back to the host while forward and backward run.

On an accelerator a host read of a tensor (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, ...)
stalls the training thread until the device catches up. The check runs on the CPU: every op
that would force such a read is counted on the training thread while a monitored step's
forward and backward run, under a TorchDispatchMode (for the aten ops) and with the Python
entry points that read a tensor without dispatching (`tolist`, `numpy`, `float()`, ...)
wrapped. An unmonitored step reads nothing, so every read counted is the monitor's.

The statistics take one CPU-only shortcut (a finite 0-d CPU witness proves a NaN/Inf count
zero; reading it waits for nothing). MSMON_DEVICE_PATH=1 turns every CPU-only route off, so the
CPU runs exactly the accelerators' code: that run must read nothing at all.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ALL_OPS
from msmon import TrainerMon
from msmon.stats import native
from msmon.stats import reductions as stats

aten = torch.ops.aten
# ops whose result the host must see before it can go on (values or data-dependent shapes)
HOST_READ_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.allclose.default,
}
# Tensor methods that read values on the host without going through the dispatcher
PYTHON_READS = ("tolist", "numpy", "item", "__bool__", "__float__", "__int__", "__index__")


TORCH_DIR = Path(torch.__file__).resolve().parent
STATS_FILE = str(Path(stats.__file__).resolve())


def asking_frame(stack: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame that is neither torch's nor this counting machinery's: the code
    that asked for the read. Decided by where a file lies, not by words in its path (a clone
    in a folder named `msmon` puts torch's own frames, such as the dynamo-disable wrapper
    around `__torch_dispatch__`, under a path that contains it)."""
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if str(path) != str(Path(__file__).resolve()) and not path.is_relative_to(TORCH_DIR):
            return frame
    return None


class HostReads(TorchDispatchMode):
    """Counts host reads (with where they came from) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.scalars: list[bool] = []  # per read: was it of a 0-d CPU tensor (a memory load)?
        self.thread = threading.get_ident()

    def note(self, what: str, t: torch.Tensor | None = None) -> None:
        if threading.get_ident() != self.thread:  # the writer thread reads host copies
            return
        self.scalars.append(t is not None and t.dim() == 0 and t.device.type == "cpu")
        where = asking_frame(traceback.extract_stack()[:-2])
        self.seen.append(f"{what} at {where.filename}:{where.lineno}" if where else what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_OPS:
            self.note(str(func), args[0] if args and isinstance(args[0], torch.Tensor) else None)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads():
    mode = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in PYTHON_READS}

    def wrapped(name, original):
        def read(self, *args, **kwargs):
            mode.note(f"Tensor.{name}", self)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrapped(name, original))
    try:
        with mode:
            yield mode
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Net(torch.nn.Module):
    """Linear, norm, activation, dropout and a loop-called module: every hook kind runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(12, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.cell = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.embed(x)))
        for _ in range(3):
            h = torch.tanh(self.cell(h))
        return self.head(torch.nn.functional.dropout(h, 0.1, self.training))


FULL_CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
    "cc_distribution": {"enable": True},
    "nan_origin": True,
    "format": "csv",
    "ops": ALL_OPS,
    "alert": {
        "rules": [
            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
            {"rule_name": "AnomalyNan", "args": {}},
        ]
    },
}


def ddp_training(config, write_config, grad_acc_steps: int):
    """Net under DDP with AdamW, and its monitor (None when config is None)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = None
    if config is not None:
        mon = TrainerMon(write_config(config))
        mon.set_monitor(model, optimizer, grad_acc_steps=grad_acc_steps)
    return model, optimizer, mon


def reads_in_forward_backward(config, write_config, steps: int = 3) -> tuple[list[str], list[bool]]:
    """Train `steps` steps (monitored when config is not None); the host reads counted
    between the start of each forward and the end of its backward, and per read whether it
    was of a 0-d CPU tensor."""
    model, optimizer, mon = ddp_training(config, write_config, grad_acc_steps=2)
    seen: list[str] = []  # what read, and the msmon line that asked
    scalars: list[bool] = []
    for _ in range(steps):
        for micro in range(2):
            x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
            sync = contextlib.nullcontext() if micro == 1 else model.no_sync()
            with sync, counting_host_reads() as reads:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            seen.extend(reads.seen)
            scalars.extend(reads.scalars)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    if mon is not None:
        assert mon.steps_recorded == steps
        mon.close()
    return seen, scalars


def test_an_unmonitored_step_reads_nothing_back_so_the_check_sees_only_the_monitor(world_of_one, write_config):
    assert reads_in_forward_backward(None, write_config) == ([], [])


@pytest.fixture
def accelerator_logic(device_path):
    """MSMON_DEVICE_PATH=1: exactly the code an accelerator takes."""


def test_every_collector_on_the_torch_path_reads_nothing_back_during_forward_and_backward(
    world_of_one, accelerator_logic, write_config, output_dir
):
    seen, _ = reads_in_forward_backward(FULL_CONFIG, write_config)
    assert seen == []


def test_every_collector_with_the_native_kernel_reads_nothing_back_during_forward_and_backward(
    world_of_one, write_config, output_dir, monkeypatch
):
    monkeypatch.setattr(stats, "CPU_SHORTCUTS", False)  # the kernel, without the CPU's witness reads
    monkeypatch.setenv(native.ENV, "1")
    native._loaded, native._tried = None, False
    if native.load() is None:
        pytest.fail("the native statistics did not build (a C++ compiler is a test requirement)")
    seen, _ = reads_in_forward_backward(FULL_CONFIG, write_config)
    assert seen == []


def test_on_the_cpu_the_only_reads_are_of_the_monitors_own_0d_cpu_results(world_of_one, write_config, output_dir):
    seen, scalars = reads_in_forward_backward(FULL_CONFIG, write_config)
    assert seen and all(scalars), [what for what, ok in zip(seen, scalars) if not ok]
    assert all(what.rsplit(":", 1)[0].endswith(f" at {STATS_FILE}") for what in seen), seen


def reads_in_optimizer_steps(config, write_config, steps: int = 3) -> int:
    """Host reads on the training thread during `steps` optimizer steps (clip, step, zero_grad),
    where the monitor computes the step's statistics and hands them to the writer."""
    model, optimizer, mon = ddp_training(config, write_config, grad_acc_steps=1)
    count = 0
    for _ in range(steps):
        x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with counting_host_reads() as reads:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        count += len(reads.seen)
    if mon is not None:
        assert mon.steps_recorded == steps
        mon.close()
    return count


def test_the_step_end_adds_no_host_read_to_the_optimizers_own(
    world_of_one, accelerator_logic, write_config, output_dir
):
    """AdamW reads its CPU step counters itself; the monitor's statistics, alerts and the copy
    to the writer (non-blocking on an accelerator) add none on the training thread."""
    assert reads_in_optimizer_steps(FULL_CONFIG, write_config) == reads_in_optimizer_steps(None, write_config)


def test_the_device_path_switch_turns_off_the_native_kernel_and_the_cpu_shortcuts(device_path, monkeypatch):
    monkeypatch.setenv(native.ENV, "1")
    native._loaded, native._tried = None, False
    assert native.readable_rows() is None
    from msmon.stats.device_path import host_code

    assert not host_code(torch.device("cpu"))
    assert not stats._reads_are_free(torch.zeros(2))
