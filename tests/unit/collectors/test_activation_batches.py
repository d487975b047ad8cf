"""On the accelerator path activation hooks note tensors and read them in batches
(msmon.runtime.hook_batch): same rows, same order, values checked against plain torch, a tensor
changed before its batch point left out (never misreported), and few batch reads per step."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import ALL_OPS, MLP, assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon
from msmon.runtime import hook_batch
from msmon.stats import device_path as path_switch
from msmon.stats import engine


def run(write_config, model, cfg, steps=1, make_input=lambda: torch.randn(6, 8), lr=0.0):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mon = TrainerMon(write_config({"xy_distribution": True, "format": "csv", "ops": ALL_OPS, **cfg}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for _ in range(steps):
        model(make_input()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()


class Loop(torch.nn.Module):
    """A cell called three times per forward (one RowGroup per key) between other modules."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.cell = torch.nn.Linear(8, 8)
        self.act = torch.nn.Tanh()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = self.act(self.cell(h))
        return self.out(h)


@pytest.fixture
def spy_batches(monkeypatch):
    """Counts the batch reads the hook batch makes (the real batch_stats runs)."""
    calls = []

    def counting(tensors, ops, eps):
        calls.append(len(tensors))
        return engine.batch_stats(tensors, ops, eps)

    monkeypatch.setattr(hook_batch, "batch_stats", counting)
    return calls


def rows_in_order(output_dir, category):
    return [(r["step"], r["micro_step"], r["name"], r) for r in read_csv_rows(rank_dir(output_dir), category)]


@pytest.mark.parametrize("each_call", [False, True])
def test_batched_rows_come_in_the_host_paths_order_with_its_values(
    write_config, tmp_path, monkeypatch, spy_batches, each_call
):
    written = {}
    for path in ("host", "device"):
        out = tmp_path / path
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        if path == "device":
            monkeypatch.setenv(path_switch.ENV, "1")
        from msmon.stats import device_path

        device_path.refresh()
        torch.manual_seed(0)
        run(write_config, Loop(), {"all_xy": True, "xy_each_call": each_call}, steps=2, lr=0.1)
        written[path] = {c: rows_in_order(out, c) for c in ("actv", "actv_grad")}
    assert spy_batches, "the device path read nothing in batches"
    for category, host_rows in written["host"].items():
        device_rows = written["device"][category]
        assert [r[:3] for r in device_rows] == [r[:3] for r in host_rows], category
        assert len(host_rows) >= 14  # 4 modules x 2 slots x 2 steps, less the gradient of the input
        for (_, _, name, d), (_, _, _, h) in zip(device_rows, host_rows):
            for op in ALL_OPS:
                assert float(d[op]) == pytest.approx(float(h[op]), rel=1e-5, abs=1e-6), (category, name, op)


def test_a_step_reads_its_activations_in_a_few_batches_not_one_read_per_tensor(
    write_config, output_dir, device_path, spy_batches
):
    steps = 3
    run(write_config, Loop(), {"all_xy": True}, steps=steps)
    rows = len(read_csv_rows(rank_dir(output_dir), "actv")) + len(read_csv_rows(rank_dir(output_dir), "actv_grad"))
    assert rows == steps * (2 * 4 + 2 * 4 - 1)  # inp, cell, act, out; the model input has no gradient
    # one batch at the end of the forward, one at the end of the backward; each distinct tensor
    # read once: 9 in forward (x, then each module's output), their 8 gradients (not x's)
    assert spy_batches == [9, 8] * steps


@pytest.mark.parametrize("budget", [None, "1"])
def test_an_in_place_module_and_a_one_byte_budget_read_the_notes_early_with_the_right_values(
    write_config, output_dir, device_path, spy_batches, monkeypatch, caplog, budget
):
    """MLP's ReLU(inplace=True) overwrites fc1's output: the notes are read before it runs (and,
    with a budget of one byte, each note at once)."""
    if budget is not None:
        monkeypatch.setenv(hook_batch.BUDGET_ENV, budget)
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 8)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        run(write_config, model, {"all_xy": True}, make_input=lambda: x)
    assert not [r for r in caplog.records if "changed in place" in r.getMessage()]
    if budget is not None:
        assert set(spy_batches) == {1}
    else:  # before the ReLU (x, fc1's output), at the forward's end (the ReLU's, fc2's output),
        # at the backward's end (the gradients of fc2's output, the ReLU's output and its input)
        assert spy_batches == [2, 2, 3]
    h = model.fc1(x)
    a = torch.relu(h)
    actv = {r["name"]: r for r in read_csv_rows(rank_dir(output_dir), "actv")}
    expected = {"fc1.input": x, "fc1.output": h, "act.input": h, "act.output": a, "fc2.output": model.fc2(a)}
    for name, tensor in expected.items():
        assert_row_matches(actv[name], reference_stats(tensor))


class ScaledInPlace(torch.nn.Module):
    """The user's own code doubles fc1's output in place, outside every module, after fc1's hook."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(2.0)
        return self.fc2(h)


def test_a_tensor_changed_in_place_before_its_batch_loses_that_row_once_then_is_read_in_its_hook(
    write_config, output_dir, device_path, caplog
):
    torch.manual_seed(0)
    model = ScaledInPlace()
    x = torch.randn(6, 8)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        run(write_config, model, {"all_xy": True}, steps=3, make_input=lambda: x)
    actv = {(r["step"], r["name"]): r for r in read_csv_rows(rank_dir(output_dir), "actv")}
    # step 0: fc1's output was overwritten before the batch point: left out, not misreported
    assert ("0", "fc1.output") not in actv
    said = [r.getMessage() for r in caplog.records if "changed in place after its hook" in r.getMessage()]
    assert len(said) == 1 and "fc1.output" in said[0]
    # later steps read it in the hook: the value before the doubling (lr=0: the same weights)
    before = model.fc1(x)
    for step in ("1", "2"):
        assert_row_matches(actv[(step, "fc1.output")], reference_stats(before))
        assert_row_matches(actv[(step, "fc2.input")], reference_stats(before * 2))
    assert_row_matches(actv[("0", "fc2.input")], reference_stats(before * 2))


def test_modules_called_outside_the_models_forward_are_read_at_the_next_batch_point(
    write_config, output_dir, device_path
):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"xy_distribution": True, "format": "csv", "ops": ALL_OPS, "all_xy": True}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    x = torch.randn(6, 8)
    h = model.fc1(x)  # the script calls the submodules itself: the root's forward never runs
    model.fc2(torch.relu(h)).sum().backward()
    optimizer.step()
    mon.close()
    actv = {r["name"]: r for r in read_csv_rows(rank_dir(output_dir), "actv")}
    assert_row_matches(actv["fc1.output"], reference_stats(h))
    assert_row_matches(actv["fc2.input"], reference_stats(torch.relu(h)))


def test_the_non_finite_origin_is_told_by_batched_rows(write_config, output_dir, device_path):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", "nan_origin": True, "all_xy": True, "ops": ["min", "max"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for step in range(2):
        x = torch.randn(3, 8)
        if step == 1:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["tensor"]) == (1, "fc1.input")
