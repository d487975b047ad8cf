"""What a step's loss and gradient rows belong to, in one process: the value backward started
from (not what the script wrote into the loss tensor afterwards), the model whose backward pass
it was (not a model whose non-scalar backward ran before), and the optimizer step (not an
iteration whose step a GradScaler skipped). Checked against values the script itself kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon


def as_written(value: float):
    """A value as the CSV keeps it (6 decimals from 1 up, 6 significant digits below 1)."""
    return pytest.approx(value, rel=1e-5, abs=1e-6)


def loss_rows(directory) -> dict[tuple[int, int], float]:
    return {(int(r["step"]), int(r["micro_step"])): float(r["value"]) for r in read_csv_rows(directory, "loss")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_loss_row_is_the_value_backward_started_from_not_what_the_script_wrote_into_it_after(
    write_config, output_dir, dtype
):
    """A script that averages its loss over ranks for logging does it in place after backward
    (`dist.all_reduce(loss.detach())`): here the same in-place write, on one process. Neither
    the row (a float64 loss is recorded as it is, no copy) nor the step's losses the rank
    comparison reads (ctx.losses, read at the optimizer step) may see it."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"loss_distribution": True, "format": ["csv"]}))
    mon.set_monitor(model, optimizer)
    seen_by_the_step: list[list[float]] = []
    optimizer.register_step_pre_hook(lambda *_: seen_by_the_step.append([float(t) for t in mon.ctx.losses]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    started_from = []
    for step in range(3):
        loss = model(torch.randn(5, 8, dtype=dtype)).square().mean()
        started_from.append(loss.item())
        if step == 1:
            scaler.scale(loss).backward()  # the unscaled loss the scaler was given, overwritten after
        else:
            loss.backward()
        loss.detach().mul_(0).add_(1234.0)  # the script's own in-place write, after backward
        if step == 1:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert loss_rows(rank_dir(output_dir)) == {(step, 0): as_written(v) for step, v in enumerate(started_from)}
    assert seen_by_the_step == [[v] for v in started_from]


def test_a_non_scalar_backward_of_one_model_does_not_give_another_models_loss_to_the_first(
    write_config, output_dir, tmp_path
):
    """Two models, two optimizers, two monitors: model A's backward runs on its output with a
    gradient (no loss), then model B's on a scalar. A's monitor records no loss for that step;
    B's records B's."""
    torch.manual_seed(0)
    first, second = MLP(), MLP()
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    config = write_config({"loss_distribution": True, "format": ["csv"]})
    mon_first, mon_second = TrainerMon(config), TrainerMon(config)
    mon_first.set_monitor(first, opt_first)
    mon_second.set_monitor(second, opt_second)
    losses_second = []
    for _ in range(3):
        out = first(torch.randn(5, 8))
        out.backward(torch.ones_like(out))  # a non-scalar backward: no loss
        loss = second(torch.randn(5, 8)).square().mean()
        loss.backward()
        losses_second.append(loss.item())
        for opt in (opt_first, opt_second):
            opt.step()
            opt.zero_grad()
    mon_first.close()
    mon_second.close()
    assert loss_rows(Path(mon_first.log_dir)) == {}
    assert loss_rows(Path(mon_second.log_dir)) == {(step, 0): as_written(v) for step, v in enumerate(losses_second)}


def test_iterations_a_grad_scaler_skips_are_no_steps_and_every_later_step_has_its_rows(write_config, output_dir):
    """The first two iterations' scaled losses overflow (to inf, forced: as in the first steps
    of fp16 training, the scale is too large): GradScaler.step does not call optimizer.step, and
    the scale comes down. Those iterations are not counted as micro-batches of step 0:
    grad_acc_steps is inferred as 1, and every step that was taken has its grad_unreduced rows
    (the statistics of the script's own `.grad` after backward, scaled) and its loss."""
    ops = ["norm", "min", "max"]
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config({"wg_distribution": True, "loss_distribution": True, "format": ["csv"], "ops": ops}),
        params_have_main_grad=False,
    )
    mon.set_monitor(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    steps: list[dict] = []  # the script's own values of each step that was taken
    skipped = 0
    for iteration in range(6):
        loss = model(torch.randn(5, 8)).square().mean() * (float("inf") if iteration < 2 else 1.0)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        grads = {n: reference_stats(p.grad, ops) for n, p in model.named_parameters()}
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if scaler.get_scale() < scale:
            skipped += 1
        else:
            steps.append({"loss": loss.item(), "grads": grads})
    mon.close()
    assert skipped == 2 and len(steps) == 4
    assert mon.ctx.grad_acc_steps == 1 and mon.ctx.step == len(steps)
    directory = rank_dir(output_dir)
    assert loss_rows(directory) == {(step, 0): as_written(s["loss"]) for step, s in enumerate(steps)}
    rows = read_csv_rows(directory, "grad_unreduced")
    assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted(
        (step, name) for step, s in enumerate(steps) for name in s["grads"]
    )
    for row in rows:
        expected = steps[int(row["step"])]["grads"][row["name"]]
        for op in ops:
            assert float(row[op]) == as_written(expected[op]), (row["step"], row["name"], op)
