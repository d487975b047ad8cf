"""AnomalyRankOutlier's loss statistic is read from the loss rows that loss_distribution records,
on the writer thread, after the step's one device-to-host copy: the rule makes no copy of its own.
The loss rows are a column category of their own, which the writer takes out of the StepRecord
it hands on, so the rule reads them from the step's host batch. (The exchange across ranks, and
the one copy per step with the rule on, are tested end to end: tests/e2e/test_rank_outlier.py.)"""

from __future__ import annotations

import math

import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.collectors.rank_outlier.collector import OutlierState, StatisticsConsumer
from msmon.collectors.rank_outlier.statistics import RankStatistics, mean_loss
from msmon.records.rows import RowKey


def test_the_loss_is_the_mean_of_the_steps_loss_rows_and_absent_without_them():
    keys = [RowKey("actv", "fc1.input", 0, 0), RowKey("loss", "loss", 0, 0, op="value")]
    keys += [RowKey("grad_unreduced", "fc1.weight"), RowKey("loss", "loss", 0, 1, op="value")]
    losses = torch.tensor([0.75, 1.5])
    table = torch.tensor([[3.0, 1.0], [0.75, 0.75], [2.0, 0.5], [1.5, 1.5]], dtype=torch.float64)
    assert mean_loss(keys, table) == losses.double().mean().item() == 1.125
    assert mean_loss([keys[0], keys[2]], table[[0, 2]]) is None  # loss_distribution off: no loss
    assert math.isnan(mean_loss(keys, table.index_fill(0, torch.tensor([3]), math.nan)))  # left to the spread


def test_the_writer_hands_the_rule_each_steps_mean_loss_as_the_script_computed_it(write_config, output_dir):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"loss_distribution": True, "wg_distribution": True, "ops": ["norm"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=2)
    state = OutlierState(5.0)
    jobs: list[RankStatistics] = []
    state.exchange.start("msmon-test-outlier", 0, state, jobs.append, "AnomalyRankOutlier", "comparing the ranks")
    mon.ctx.watch_steps(StatisticsConsumer(state, mon.ctx.board))  # what the rule does once it has its group
    means = []
    for _ in range(3):
        losses = []
        for _ in range(2):
            loss = model(torch.randn(5, 8)).square().mean()
            loss.backward()
            losses.append(loss.detach().double())
        means.append(torch.stack(losses).mean().item())
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert state.exchange.flush(10.0) == 0
    assert [job.step for job in jobs] == [0, 1, 2]
    assert [job.values["loss"] for job in jobs] == means  # float32 losses, their mean in float64: exact
    assert all(job.values["grad"] > 0 for job in jobs)


def test_a_loss_departure_is_said_as_the_loss_passed_to_backward():
    """The loss rows hold what backward ran on (a loss the script divided by its accumulation
    steps reads divided), so the rule's message says so rather than 'loss'."""
    from msmon.anomaly.rank_history import TensorHistory
    from msmon.anomaly.rank_spread import spread
    from msmon.collectors.rank_outlier.compare import Departure, dump_record
    from msmon.collectors.rank_outlier.statistics import GRADIENT, LOSS, Tensors

    column = [0.5, 0.52, 2.6, 0.49]
    ranks_spread = spread(column)
    assert ranks_spread is not None
    hits = [
        Departure(LOSS, 2.6, ranks_spread.score(2.6), column, ranks_spread.median, ranks_spread.scale),
        Departure(GRADIENT, 9.0, 7.0, column, ranks_spread.median, ranks_spread.scale),
    ]
    mine = RankStatistics(4, {"actv": 1.0, "loss": 2.6, "grad": 9.0}, {"grad": Tensors(), "actv": Tensors()}, 0)
    record = dump_record(mine, hits, {}, 2, [0, 1, 2, 3], 5.0, TensorHistory(5.0))
    assert record["message"].startswith("rank 2's loss (as passed to backward) 2.6 is ")
    assert record["statistic"] == "loss"  # the statistic's name in the record stays as it was
