"""grad_reduced is the gradient as the optimizer consumes it, also where something rewrote
`.grad` in place after backward: clipping, and a GradScaler's `unscale_`, which does not move
the version counter (before the fix grad_reduced repeated the scaled row, 4096 times too large)."""

from __future__ import annotations

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon


def reduced_norms(mon: TrainerMon) -> dict[str, float]:
    reduced, _ = mon.generate_wgrad_metrics()
    return {tag.split("/")[0].split(":", 1)[1]: ops["norm"] for tag, ops in reduced.items()}


def unreduced_norms(mon: TrainerMon) -> dict[str, float]:
    _, unreduced = mon.generate_wgrad_metrics()
    return {tag.split("/")[0].split(":", 1)[1]: ops["norm"] for tag, ops in unreduced.items()}


def monitored(write_config) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainerMon, dict[str, float]]:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config({"wg_distribution": True, "format": "api", "ops": ["norm"]}), params_have_main_grad=False
    )
    mon.set_monitor(model, optimizer)
    consumed: dict[str, float] = {}  # what the optimizer steps with, seen by a plain pre-hook of the script's own
    names = {p: n for n, p in model.named_parameters()}
    optimizer.register_step_pre_hook(
        lambda opt, *_: consumed.update(
            {names[p]: float(p.grad.norm()) for group in opt.param_groups for p in group["params"]}
        )
    )
    return model, optimizer, mon, consumed


def test_grad_reduced_is_the_unscaled_gradient_under_a_grad_scaler(write_config, output_dir):
    model, optimizer, mon, consumed = monitored(write_config)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    for _ in range(3):
        scaler.scale(model(torch.randn(5, 8)).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        got = reduced_norms(mon)
        assert set(got) == set(consumed)
        for name, norm in consumed.items():
            assert got[name] == pytest.approx(norm, rel=1e-5), name
        scaled = unreduced_norms(mon)  # grad_unreduced: the gradient backward left, still scaled
        for name, norm in consumed.items():
            assert scaled[name] == pytest.approx(norm * scaler.get_scale(), rel=1e-3), name
    mon.close()


def test_grad_reduced_is_the_clipped_gradient_and_grad_unreduced_the_one_backward_left(write_config, output_dir):
    model, optimizer, mon, consumed = monitored(write_config)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        left = {n: float(p.grad.norm()) for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        optimizer.step()
        optimizer.zero_grad()
        got, unreduced = reduced_norms(mon), unreduced_norms(mon)
        for name, norm in consumed.items():
            assert got[name] == pytest.approx(norm, rel=1e-5), name
            assert unreduced[name] == pytest.approx(left[name], rel=1e-5), name
            assert norm < left[name]  # the clipping did rewrite it
    mon.close()


def test_the_scaler_is_put_back_when_the_last_monitor_closes(write_config, output_dir):
    original = torch.amp.GradScaler.unscale_
    _, _, mon, _ = monitored(write_config)
    assert torch.amp.GradScaler.unscale_ is not original  # watched while a monitor records gradients
    mon.close()
    assert torch.amp.GradScaler.unscale_ is original
