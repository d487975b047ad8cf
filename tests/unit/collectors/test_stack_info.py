"""stack_info: each module's first forward call stack, written once to stack_info.csv; after
the first step no stack is walked and no hook is left."""

from __future__ import annotations

import csv
import os

import torch

import msmon
from conftest import MLP, ROOT, rank_dir
from msmon import TrainerMon
from msmon.collectors import stack_info

HERE = os.path.abspath(__file__)


def read_stacks(directory) -> dict[str, str]:
    with open(directory / "stack_info.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["module_name", "stack_info"]
    return {name: stack for name, stack in rows[1:]}


class Twice(torch.nn.Module):
    """Calls one module from two lines: the first call's line is the one recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.shared(x)  # first call
        return self.shared(x)  # second call


def line_of(marker: str) -> int:
    with open(HERE, encoding="utf-8") as fh:
        return next(i for i, text in enumerate(fh, 1) if marker in text and "line_of" not in text)


def train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()  # the training loop's call
        optimizer.step()
        optimizer.zero_grad()


def test_stack_info_csv_holds_each_modules_first_call_stack_without_torch_or_msmon_frames(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"stack_info": True, "format": "tensorboard"}), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    train(model, optimizer, 2)
    mon.close()
    stacks = read_stacks(rank_dir(output_dir))
    assert list(stacks) == ["0:", "0:fc1", "0:act", "0:fc2"]  # msprobe's names: the model itself is "0:"
    loop = f"File {HERE}, line {line_of('the training loop')}, in train, \n"
    for name, stack in stacks.items():
        assert loop in stack, (name, stack)
        for package in (torch, msmon):
            assert os.path.dirname(package.__file__) not in stack
    conftest_forward = "return self.fc2(self.act(self.fc1(x)))"
    assert stacks["0:fc1"].startswith(f"File {ROOT / 'tests' / 'conftest.py'}, line ")
    assert f"in forward, \n {conftest_forward} \n" in stacks["0:fc1"]  # innermost frame first
    assert stacks["0:"].startswith(loop)


def test_capture_is_switched_off_after_the_first_step(write_config, output_dir, monkeypatch):
    walks = []
    real = stack_info.capture_stack
    monkeypatch.setattr(stack_info, "capture_stack", lambda *a, **k: walks.append(1) or real(*a, **k))
    model = Twice()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"stack_info": True, "format": "csv"}), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    train(model, optimizer, 1)
    assert len(walks) == 2  # the model and its shared layer, once each although the layer ran twice
    assert not model._forward_pre_hooks and not model.shared._forward_pre_hooks
    path = rank_dir(output_dir) / "stack_info.csv"
    written = path.read_bytes()
    train(model, optimizer, 3)
    mon.close()
    assert len(walks) == 2
    assert path.read_bytes() == written
    stacks = read_stacks(rank_dir(output_dir))
    assert f"line {line_of('# first call')}, in forward" in stacks["0:shared"]
    assert f"line {line_of('# second call')}," not in stacks["0:shared"]


def test_an_existing_stack_info_csv_is_kept(write_config, output_dir):
    """A resumed run (append_output) writes into a directory that already has the file."""
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"stack_info": True, "format": "csv"}), params_have_main_grad=False)
    (rank_dir(output_dir) / "stack_info.csv").write_text("module_name,stack_info\nearlier,run\n")
    mon.set_monitor(model, optimizer)
    train(model, optimizer, 2)
    mon.close()
    assert read_stacks(rank_dir(output_dir)) == {"earlier": "run"}
    assert not model.fc1._forward_pre_hooks
