"""The first non-finite origin: the module where NaN/Inf first appears, found once per step."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.anomaly.origin import find_origin
from msmon.collectors.nan_origin import collector as nan_origin
from msmon.records.rows import RowKey

# How the flags are told: by reading each tensor (the origin alone), or by the rows the
# activation collector took of the same tensors (all_xy), from min/max or from NaN/Inf counts;
# with a norm alone the rows cannot tell, and the tensors are read again.
FLAG_SOURCES = {
    "read": {"nan_origin": True},
    "rows min/max": {"nan_origin": True, "all_xy": True, "ops": ["norm", "min", "max"]},
    "rows nans/infs": {"nan_origin": True, "all_xy": True, "ops": ["mean", "nans", "infs"]},
    "rows cannot tell": {"nan_origin": True, "all_xy": True, "ops": ["norm"]},
}


@pytest.fixture(params=list(FLAG_SOURCES))
def flag_source(request):
    return FLAG_SOURCES[request.param]


class Poisoned(torch.nn.Module):
    """fc1 -> act -> fc2 -> head; `poison_step` makes the user's own code put inf between
    fc2 and head (functional code, outside any module)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.head = torch.nn.Linear(4, 1)
        self.poison_step = None
        self.step = 0

    def forward(self, x):
        h = self.body(x)
        if self.step == self.poison_step:
            h = torch.where(h > 0, float("inf"), h)
        return self.head(h).sum()


def poison_output(module, step_holder, step):
    """The user's fault: a forward hook of their own that makes the module's output inf."""

    def hook(mod, args, output):
        if step_holder.step == step:
            return torch.where(output > 0, float("inf"), output)
        return None

    return module.register_forward_hook(hook)


def test_forward_origin_names_the_module_step_and_micro_step(write_config, output_dir):
    model = Poisoned()
    poison_output(model.body.fc2, model, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config(
            {"wg_distribution": True, "format": "csv", "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=2)
    for step in range(5):
        model.step = step
        for _ in range(2):
            model(torch.randn(3, 8)).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert origin == {
        "step": 3,
        "rank": 0,
        "stage": "forward",
        "module": "body.fc2",
        "tensor": "body.fc2.output",
        "micro_step": 0,
        "vpp_stage": 0,
    }
    records = [
        json.loads(l)
        for l in (output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl").read_text().splitlines()  # noqa: E741
    ]
    nan_origin = [r for r in records if r["rule"] == "NanOrigin"]
    assert (nan_origin[0]["step"], nan_origin[0]["micro_step"], nan_origin[0]["name"]) == (3, 0, "body.fc2.output")


def test_non_finite_values_made_outside_any_module_name_the_first_module_they_reach(
    write_config, output_dir, flag_source
):
    model = Poisoned()
    model.poison_step = 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", **flag_source}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for step in range(2):
        model.step = step
        model(torch.randn(3, 8)).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["module"], origin["tensor"]) == (1, "head", "head.input")


class BadWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x)))).sum()


def test_a_module_with_a_nan_weight_is_the_origin(write_config, output_dir, flag_source):
    model = BadWeight()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", **flag_source}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.b.weight[0, 0] = float("nan")
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert (origin["step"], origin["module"], origin["stage"]) == (1, "b", "forward")


class NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class BackwardFault(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.bad = NanGradModule()
        self.c = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.c(self.bad(self.a(x))).sum()


class NanGradModule(torch.nn.Module):
    def forward(self, x):
        return NanGrad.apply(x)


def test_backward_origin_is_the_module_whose_input_grad_turns_non_finite(write_config, output_dir, flag_source):
    model = BackwardFault()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", **flag_source}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert (origin["stage"], origin["module"], origin["tensor"]) == ("backward", "bad", "bad.input")


def test_find_origin_requires_finite_inputs():
    keys = [
        RowKey("actv", "a.input", 0, 0),
        RowKey("actv", "a.output", 0, 0),
        RowKey("actv", "b.input", 0, 0),
        RowKey("actv", "b.output", 0, 0),
    ]
    assert find_origin(keys, [True, True, True, True]) is None
    origin = find_origin(keys, [True, False, False, False])
    assert origin.module == "a" and origin.stage == "forward"
    # non-finite data arriving at the first module: reported where it entered
    origin = find_origin(keys, [False, False, False, False])
    assert (origin.module, origin.tensor) == ("a", "a.input")


@pytest.mark.parametrize("source", list(FLAG_SOURCES))
def test_tensors_the_activation_collector_read_are_not_read_again_for_their_flags(
    write_config, output_dir, monkeypatch, source
):
    reads = []
    real = nan_origin.finite_flag
    monkeypatch.setattr(nan_origin, "finite_flag", lambda t: reads.append(t.shape) or real(t))
    model = BackwardFault()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", **FLAG_SOURCES[source]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for _ in range(2):
        model(torch.randn(2, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    origin = mon.summary()["first_nonfinite"]
    assert (origin["stage"], origin["module"], origin["step"]) == ("backward", "bad", 0)
    if source.startswith("rows") and source != "rows cannot tell":
        # only what the activation rows do not cover: per step the loss's gradient (0-d, at the
        # model's output); the weights' gradients are flagged together, by their largest magnitude
        assert reads == 2 * [torch.Size([])]
    else:  # per step each distinct tensor once (one module's output is the next one's input, and
        # one gradient serves both names): x, a's output, bad's output, c's output; the gradients
        # of c's output, of c's and of bad's input, and the loss's (at the model's output)
        assert len(reads) == 2 * (4 + 4)


def test_a_tensor_between_two_modules_gets_one_gradient_hook_for_both_collectors(write_config, output_dir):
    """a's output is b's input: the activation collector and the origin both want its gradient,
    under both names; one hook serves the four (msmon.runtime.grad_hooks), and every row is written."""
    model = BadWeight()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", "nan_origin": True, "all_xy": True, "ops": ["min", "max"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    outputs = {}
    model.a.register_forward_hook(lambda module, args, output: outputs.setdefault("a", output))
    model(torch.randn(2, 4)).backward()
    optimizer.step()
    mon.close()
    assert len(outputs["a"]._backward_hooks) == 1
    with open(next(output_dir.rglob("actv_grad_*.csv"))) as fh:
        names = {row["name"] for row in csv.DictReader(fh)}
    assert {"a.output", "b.input", "b.output", "c.input", "c.output"} <= names


def test_a_failing_gradient_callback_switches_off_its_own_collector_only(write_config, output_dir, monkeypatch, caplog):
    """The shared gradient hook contains each collector's failure as its own hook did."""
    from msmon.collectors.activations import ActivationCollector

    def broken(self, key, grad):
        raise RuntimeError("boom")

    monkeypatch.setattr(ActivationCollector, "_on_grad", broken)
    model = BackwardFault()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(write_config({"format": "csv", **FLAG_SOURCES["rows min/max"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    loss = model(torch.randn(2, 4))
    loss.backward()  # training goes on
    optimizer.step()
    mon.close()
    failures = [r for r in caplog.records if "activations monitoring failed" in r.getMessage()]
    assert len(failures) == 1 and "boom" in failures[0].getMessage()
    origin = mon.summary()["first_nonfinite"]  # the origin's own callbacks kept running
    assert (origin["stage"], origin["module"]) == ("backward", "bad")


@pytest.mark.parametrize("asked", [None, True], ids=["switched-on-by-a-rule", "asked-for"])
def test_an_alert_rule_switching_the_origin_on_says_so_once_with_what_its_first_step_cost(
    write_config, output_dir, caplog, asked
):
    """BackwardFault per step: 4 distinct forward tensors and 4 gradients reduced once each; 3
    module calls, two hooks each; 6 gradients flagged under their names (4 distinct: each reduced once)."""
    import logging

    caplog.set_level(logging.INFO, logger="msmon")
    model = BackwardFault()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {"format": "csv", "ops": ["norm"], "alert": {"rules": [{"rule_name": "AnomalyNan"}]}}
    mon = TrainerMon(write_config(config if asked is None else {**config, "nan_origin": asked}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for _ in range(3):
        model(torch.randn(2, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    said = [r.getMessage() for r in caplog.records if "non-finite origin" in r.getMessage()]
    if asked:
        assert said == []  # the user set it: nothing to tell
    else:
        assert said == [
            'msmon[rank 0]: the alert rules switch on the non-finite origin ("nan_origin": false switches it '
            "off); in step 0 it launched 8 reductions, one kernel each, made 6 module hook calls, flagged 6 "
            "gradients in backward, and no host sync"
        ]
