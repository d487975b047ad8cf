"""When weight gradients are read: at the end of backward where nothing can change them before,
in the hooks otherwise, and never reporting a gradient that changed after it was accumulated."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import MLP, reference_stats
from msmon import TrainerMon
from msmon.collectors.grads.collector import GradCollector


def grad_collector(mon: TrainerMon) -> GradCollector:
    return next(c for c in mon.collectors if isinstance(c, GradCollector))


def norms(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    return {tag.split("/")[0].split(":", 1)[1]: ops["norm"] for tag, ops in metrics.items()}


def test_single_process_gradients_are_read_at_the_end_of_backward_and_equal_the_accumulated_ones(
    write_config, output_dir
):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        write_config({"wg_distribution": True, "format": "api", "ops": ["norm", "max", "zeros"]}),
        params_have_main_grad=False,
    )
    mon.set_monitor(model, optimizer)
    for _ in range(3):
        model(torch.randn(5, 8)).square().mean().backward()
        expected = {n: reference_stats(p.grad, ["norm", "max", "zeros"]) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        _, unreduced = mon.generate_wgrad_metrics()
        assert set(norms(unreduced)) == set(expected)
        for tag, ops in unreduced.items():
            name = tag.split("/")[0].split(":", 1)[1]
            for op, value in expected[name].items():
                assert ops[op] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, op)
    assert grad_collector(mon).batched
    mon.close()


def test_a_gradient_changed_before_backward_ends_is_left_out_once_then_read_in_the_hooks(
    write_config, output_dir, caplog
):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: steps are comparable
    mon = TrainerMon(
        write_config({"wg_distribution": True, "format": "api", "ops": ["norm"]}), params_have_main_grad=False
    )
    mon.set_monitor(model, optimizer)
    x = torch.randn(5, 8, requires_grad=True)

    def double_fc2_grad(grad):  # runs after fc2's gradient was accumulated, before backward ends
        model.fc2.weight.grad.mul_(2)
        return grad

    x.register_hook(double_fc2_grad)
    seen = []
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            reduced, unreduced = mon.generate_wgrad_metrics()
            seen.append((norms(reduced), norms(unreduced)))
    (reduced0, unreduced0), (reduced1, unreduced1) = seen
    assert "fc2.weight" not in unreduced0 and "fc1.weight" in unreduced0  # left out, never misreported
    assert "gradients changed between their accumulation and the end of backward" in caplog.text
    assert not grad_collector(mon).batched
    # from the next step on the hook reads it right after accumulation, before it is doubled
    assert unreduced1["fc2.weight"] == pytest.approx(reduced1["fc2.weight"] / 2, rel=1e-6)
    mon.close()


def test_a_parameter_with_another_post_accumulate_hook_is_read_in_its_hook(write_config, output_dir):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        write_config({"wg_distribution": True, "format": "api", "ops": ["norm"]}), params_have_main_grad=False
    )
    mon.set_monitor(model, optimizer)
    at_accumulation = {}

    def scale_after_reading(param):  # e.g. an optimizer-in-backward hook rewriting the gradient
        at_accumulation["fc1.bias"] = param.grad.norm().item()
        param.grad.mul_(0.5)

    model.fc1.bias.register_post_accumulate_grad_hook(scale_after_reading)
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    _, unreduced = mon.generate_wgrad_metrics()
    assert norms(unreduced)["fc1.bias"] == pytest.approx(at_accumulation["fc1.bias"], rel=1e-6)
    assert grad_collector(mon).batched  # the other parameters still wait for the end of backward
    mon.close()
