"""loss_distribution: the scalar each backward pass starts from, recorded with no change to the
script; what a backward on something else does; the patch undone on close."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows
from msmon import TrainerMon

CONFIG = {"loss_distribution": True, "format": ["csv"]}


def monitored(write_config) -> tuple[TrainerMon, MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer)
    return mon, model, optimizer


def loss_rows(output_dir) -> dict[tuple[int, int], float]:
    return {
        (int(r["step"]), int(r["micro_step"])): float(r["value"]) for r in read_csv_rows(rank_dir(output_dir), "loss")
    }


def as_written(value: float):
    """A value as the CSV keeps it (6 decimals from 1 up, 6 significant digits below 1)."""
    return pytest.approx(value, rel=1e-5, abs=1e-6)


def test_each_backward_call_on_a_scalar_is_one_micro_step_with_the_scripts_own_value(write_config, output_dir):
    mon, model, optimizer = monitored(write_config)
    seen_by_the_step: list[list[float]] = []
    # what the rank comparison reads: ctx.losses holds the step's losses when the optimizer steps
    optimizer.register_step_pre_hook(lambda *_: seen_by_the_step.append([float(t) for t in mon.ctx.losses]))
    mine = {}
    for step in range(3):
        for micro in range(2):
            loss = model(torch.randn(5, 8)).square().mean()
            if micro == 0:
                loss.backward()  # Tensor.backward
            else:
                torch.autograd.backward(loss)  # the function: recorded once, not once per layer of calls
            mine[(step, micro)] = loss.item()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    rows = loss_rows(output_dir)
    assert rows.keys() == mine.keys()
    for key, value in mine.items():
        assert rows[key] == as_written(value), key
    assert seen_by_the_step == [[mine[(s, 0)], mine[(s, 1)]] for s in range(3)]
    assert mon.ctx.losses == []  # cleared at every step's end


def test_two_losses_per_forward_are_two_rows_and_a_non_scalar_backward_none_with_one_line(
    write_config, output_dir, caplog
):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.WARNING, logger="msmon")
    mon, model, optimizer = monitored(write_config)
    values = []
    for _ in range(2):
        out = model(torch.randn(5, 8))
        first, second = out.square().mean(), out.abs().mean()
        first.backward(retain_graph=True)  # two losses of one forward: two backward passes
        second.backward(retain_graph=True)
        out.backward(torch.ones_like(out))  # a backward on a non-scalar: no loss to record
        values.append((first.item(), second.item()))
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    rows = loss_rows(output_dir)
    assert rows == {(step, micro): as_written(v) for step, pair in enumerate(values) for micro, v in enumerate(pair)}
    said = [r.getMessage() for r in caplog.records if "no loss row" in r.getMessage()]
    assert said == [
        "msmon[rank 0]: no loss row for a backward call on a tensor of several elements, not a scalar loss (said once)"
    ]


def test_a_grad_scalers_scaled_loss_is_recorded_unscaled_bit_for_bit(write_config, output_dir):
    config = dict(CONFIG, format=["api", "csv"])
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(config))
    mon.set_monitor(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    mine, recorded = [], []
    for _ in range(3):
        loss = model(torch.randn(5, 8)).square().mean()
        scaler.scale(loss).backward()
        mine.append(loss.detach().clone())
        recorded.append([t.clone() for t in mon.ctx.losses])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    mon.close()
    for loss, kept in zip(mine, recorded):
        assert len(kept) == 1 and kept[0].dtype == loss.dtype and torch.equal(kept[0], loss)
    assert [v for _, v in sorted(loss_rows(output_dir).items())] == [as_written(t.item()) for t in mine]


def test_close_puts_backward_and_the_scaler_back_and_nothing_is_recorded_after(write_config, output_dir):
    originals = (torch.Tensor.backward, torch.autograd.backward, torch.amp.GradScaler.scale)
    mon, model, optimizer = monitored(write_config)
    assert torch.Tensor.backward is not originals[0] and torch.autograd.backward is not originals[1]
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()
    mon.close()
    assert (torch.Tensor.backward, torch.autograd.backward, torch.amp.GradScaler.scale) == originals


def test_a_backward_pass_of_another_model_is_not_this_monitors_loss(write_config, output_dir):
    mon, model, optimizer = monitored(write_config)
    other = MLP()  # not monitored: a frozen reference, a GAN's other half
    mine = []
    for _ in range(2):
        other(torch.randn(5, 8)).square().mean().backward()
        loss = model(torch.randn(5, 8)).square().mean()
        loss.backward()
        other(torch.randn(5, 8)).abs().mean().backward()
        mine.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert loss_rows(output_dir) == {(step, 0): as_written(v) for step, v in enumerate(mine)}


class HalfPrecisionScaler:
    """A framework's loss scaler, as Megatron's optimizer is one: `scale_loss(loss) = scale * loss`."""

    def __init__(self) -> None:
        self.scale = torch.tensor(256.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scale * loss


class Engine:
    """A framework's entry point, as DeepSpeed's engine is one: `backward(loss)` runs backward on
    a scaled copy of the loss."""

    def backward(self, loss: torch.Tensor) -> None:
        (loss / 4 * 1024).backward()


def test_a_frameworks_declared_scaler_and_entry_point_give_the_unscaled_loss_and_nothing_else():
    from msmon.seams import backward_calls

    scaling = backward_calls.LossScaling(
        scalers=(backward_calls.Scaler(HalfPrecisionScaler, "scale_loss", lambda s: s.scale),),
        entry_points=(backward_calls.EntryPoint(Engine, "backward"),),
    )
    originals = (HalfPrecisionScaler.__dict__["scale_loss"], Engine.__dict__["backward"])
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    listening = backward_calls.listen(lambda loss, scale: seen.append((loss, scale)), lambda why: None, [scaling])
    try:
        weight = torch.nn.Parameter(torch.randn(3))
        losses = [(weight * torch.randn(3)).sum() for _ in range(2)]
        scaler = HalfPrecisionScaler()
        scaler.scale_loss(losses[0]).backward()
        Engine().backward(losses[1])
    finally:
        listening.stop()
    assert (HalfPrecisionScaler.__dict__["scale_loss"], Engine.__dict__["backward"]) == originals  # put back
    assert len(seen) == 2
    assert torch.equal(seen[0][0], losses[0].detach()) and seen[0][1] is scaler.scale
    assert torch.equal(seen[1][0], losses[1].detach()) and seen[1][1] is None
