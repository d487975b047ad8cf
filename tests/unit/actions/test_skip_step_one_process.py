"""skip_step in one process (the vote of one rank): a loss spike's step is not applied (weights
and Adam's state bit for bit as before it), training goes on, the skip is counted and written in
Megatron's tracker format (read back with Megatron's own parser's pattern) and Lightning's
skip_batches.json; max_per_run bounds it; a step run with a closure makes it stand down with one
line. The two-rank run is tests/e2e/test_actions.py's."""

from __future__ import annotations

import json
import re

import torch

from conftest import MLP, rank_dir
from msmon import TrainerMon
from msmon.output.skipped_steps import MEGATRON_STATUS

# Megatron-LM's RerunStateMachine.get_skipped_iterations_from_tracker_file reads a tracker line with
# this pattern (megatron/core/rerun_state_machine.py) and skips the iteration of a line whose status
# is RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE ("second_rerun_reproducible")
MEGATRON_TRACKER_LINE = r"ts=.+ node=.+ device=.+ jobID=.+ rank=(.+) iteration=(.+) status=(.+) .+"

CONFIG = {
    "wg_distribution": True,
    "loss_distribution": True,
    "format": "csv",
    "ops": ["norm", "max"],
    "alert": {
        "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 30}}],
        "actions": [{"on": ["AnomalyTurbulence"], "do": "skip_step", "max_per_run": 2}],
    },
}


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v.clone() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return tensors


def train(mon: TrainerMon | None, spikes: set[int], steps: int = 12) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mon is not None:
        mon.set_monitor(model, optimizer, grad_acc_steps=1)
    gen = torch.Generator().manual_seed(1)
    states = [state_of(model, optimizer)]
    for step in range(steps):
        x = torch.randn(4, 8, generator=gen)
        target = x[:, :4] * (1e3 if step in spikes else 1.0)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(state_of(model, optimizer))
    return states


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_loss_spike_step_is_not_applied_and_training_goes_on(write_config, output_dir, caplog):
    mon = TrainerMon(write_config(CONFIG))
    states = train(mon, spikes={8})
    mon.close()
    assert same(states[9], states[8])  # step 8 left weights and Adam's moments as they were
    assert not same(states[10], states[9]) and not same(states[8], states[7])  # the others were applied
    summary = json.loads((rank_dir(output_dir) / "summary.json").read_text())
    assert summary["skips"] == 1 and [s["step"] for s in summary["skipped_steps"]] == [8]
    assert summary["skipped_steps"][0]["why"].startswith("AnomalyTurbulence on the unreduced gradient of ")
    assert "msmon: step 8 is not applied on any rank (alert.actions[0] skip_step: AnomalyTurbulence" in caplog.text
    (line,) = (output_dir / "result_rejected_tracker.txt").read_text().splitlines()
    rank, iteration, status = re.search(MEGATRON_TRACKER_LINE, line).groups()
    assert (rank, iteration, status) == ("0", "9", MEGATRON_STATUS)  # Megatron skips iteration 9: msmon's step 8
    assert json.loads((output_dir / "skip_batches.json").read_text()) == [8]


def test_without_a_spike_the_monitored_run_with_skip_step_is_bit_identical_to_a_plain_one(write_config, output_dir):
    plain = train(None, spikes=set())
    mon = TrainerMon(write_config(CONFIG))
    monitored = train(mon, spikes=set())
    mon.close()
    assert all(same(a, b) for a, b in zip(plain, monitored))
    assert json.loads((rank_dir(output_dir) / "summary.json").read_text())["skips"] == 0
    assert not (output_dir / "skip_batches.json").exists()


def test_max_per_run_bounds_the_skips(write_config, output_dir, caplog):
    mon = TrainerMon(write_config(CONFIG))
    states = train(mon, spikes={6, 8, 10})
    mon.close()
    assert same(states[7], states[6]) and same(states[9], states[8]) and not same(states[11], states[10])
    assert json.loads((rank_dir(output_dir) / "summary.json").read_text())["skips"] == 2
    assert "alert.actions[0] (skip_step) skipped 2 steps, its max_per_run; it skips no more steps" in caplog.text
    assert json.loads((output_dir / "skip_batches.json").read_text()) == [6, 8]


def test_a_step_with_a_closure_makes_skip_step_stand_down_with_one_line(write_config, output_dir, caplog):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    x = torch.randn(4, 8)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    mon.close()
    lines = [r.getMessage() for r in caplog.records if "skip_step is off" in r.getMessage()]
    assert len(lines) == 1 and "runs a closure" in lines[0]
