"""Non-finite values made outside every module, in backward: by the loss (computed after the
model) or by a tensor hook that writes into a gradient. The origin is named in the step the
values appear, as the loss or the gradient itself, the same step `msmon analyse` names first;
never a step late, on a module whose inputs were finite."""

from __future__ import annotations

import json
import math

import pytest
import torch

from msmon import TrainerMon
from msmon.offline.analyse.command import run_analyse

CONFIG = {
    "wg_distribution": True,
    "format": "csv",
    "ops": ["norm", "nans"],
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
}
BAD_STEP = 1


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def train(write_config, loss_of, prepare=None, steps: int = 3) -> TrainerMon:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"step": 0}
    if prepare is not None:
        prepare(model, state)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for step in range(steps):
        state["step"] = step
        loss_of(model(torch.randn(3, 4)), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    return mon


def analysed(output_dir, tmp_path) -> dict:
    assert run_analyse(str(output_dir / "anomaly_detected"), str(tmp_path / "report.json")) == 0
    return json.loads((tmp_path / "report.json").read_text())


def test_a_loss_that_turns_non_finite_outside_the_model_is_named_as_the_origin_in_its_own_step(
    write_config, output_dir, tmp_path
):
    def loss_of(out, step):
        # the user's loss: a square root of a negative number at the bad step, outside any module
        return (-(out.square().sum() + 1.0)).sqrt() if step == BAD_STEP else out.square().mean()

    mon = train(write_config, loss_of)
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["stage"], origin["module"], origin["tensor"]) == (
        BAD_STEP,
        "backward",
        "loss",
        "loss",
    )
    report = analysed(output_dir, tmp_path)
    assert report["first_anomaly"]["step"] == BAD_STEP
    assert report["nan_origin"]["step"] == BAD_STEP and report["nan_origin"]["name"] == "loss"
    assert "the loss" in report["verdict"]


def all_nan(g: torch.Tensor) -> torch.Tensor:
    return g * math.nan


def one_inf(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[5] = -math.inf
    return g


@pytest.mark.parametrize("spoil", [all_nan, one_inf])
def test_a_tensor_hook_that_writes_nan_into_a_weight_gradient_is_named_as_the_origin_in_its_own_step(
    spoil, write_config, output_dir, tmp_path
):
    def poison(model, state):
        model.b.weight.register_hook(lambda g: spoil(g) if state["step"] == BAD_STEP else None)

    mon = train(write_config, lambda out, step: out.square().mean(), poison)
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["stage"], origin["module"], origin["tensor"]) == (
        BAD_STEP,
        "optimizer",  # the gradient as the optimizer gets it, after every hook ran
        "b",
        "b.weight",
    )
    report = analysed(output_dir, tmp_path)
    assert report["first_anomaly"]["step"] == BAD_STEP
    assert report["nan_origin"]["step"] == BAD_STEP and report["nan_origin"]["name"] == "b.weight"


def test_a_tensor_hook_that_writes_nan_into_an_activation_gradient_names_that_gradient(
    write_config, output_dir, tmp_path
):
    def poison(model, state):
        # registered before msmon's own hooks: msmon sees the gradient as the hook left it
        def on_output(module, args, output):
            if state["step"] == BAD_STEP:
                output.register_hook(lambda g: g * math.nan)

        model.b.register_forward_hook(on_output)

    mon = train(write_config, lambda out, step: out.square().mean(), poison)
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["stage"], origin["module"], origin["tensor"]) == (
        BAD_STEP,
        "backward",
        "b",
        "b.output",
    )
    assert analysed(output_dir, tmp_path)["nan_origin"]["step"] == BAD_STEP
