"""AnomalyRankOutlier's own-history test (anomaly/rank_history.py), over the statistics data-parallel
training really makes: one model, each rank its own batches, the gradients averaged as DDP does,
the rank's three statistics computed as the rule reads them (the activation norm over every
module input and output, the loss, the rank-local gradient norm). The exchange across real ranks
is tested end to end (tests/e2e/test_fault_kinds.py, tests/e2e/test_rank_outlier.py)."""

from __future__ import annotations

import math

import pytest
import torch

from msmon.anomaly.rank_history import ALPHA, DEVIATION_ALPHA, LOG_FLOOR, WARMUP, History, RankHistory, TensorHistory
from msmon.anomaly.rank_spread import departing
from msmon.collectors.rank_outlier.compare import OWN_HISTORY, Departure, dump_record
from msmon.collectors.rank_outlier.statistics import ACTIVATION, RankStatistics, Tensors

K = 5.0
KEYS = ("actv", "loss", "grad")


class Net(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.drop(self.fc1(x))))


def data_parallel_statistics(
    ranks: int,
    steps: int,
    *,
    seed: int = 0,
    batch: int = 16,
    dropout: float = 0.2,
    clip: float | None = 0.5,
    warmup: int = 0,
    lr: float = 1e-2,
    lr_jump: int | None = None,
    scaled: tuple[int, ...] = (),
    scale_from: int = 10**9,
    scale: float = 40.0,
) -> list[list[tuple[float, float, float]]]:
    """Per step, per rank: (activation norm, loss, rank-local gradient norm) of one data-parallel
    training (one model, each rank its own generator, the gradients averaged, then clipped)."""
    torch.manual_seed(seed)
    model = Net(dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(ranks)]
    squares: list[float] = []

    def note(module, inputs, output):
        squares.append(float(inputs[0].detach().norm()) ** 2 + float(output.detach().norm()) ** 2)

    hooks = [m.register_forward_hook(note) for m in (model.fc1, model.drop, model.fc2)]
    out = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = (
                lr * (min(1.0, (step + 1) / warmup) if warmup else 1.0) * (10 if lr_jump and step >= lr_jump else 1)
            )
        grads, row = [], []
        for rank in range(ranks):
            x = torch.randn(batch, 8, generator=gens[rank])
            y = x[:, :4].clone()
            if rank in scaled and step >= scale_from:
                x = x * scale
            squares.clear()
            model.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            norm = math.sqrt(sum(float(g.norm()) ** 2 for g in grads[-1]))
            row.append((math.sqrt(sum(squares)), loss.item(), norm))
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / ranks
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        out.append(row)
    for hook in hooks:
        hook.remove()
    return out


def alarms(rows, k: float = K) -> list[tuple[int, str, int]]:
    """(step, statistic, rank) of every departure from the own history, through the whole run."""
    history = RankHistory(len(rows[0]), k)
    found = []
    for step, row in enumerate(rows):
        for j, key in enumerate(KEYS):
            found += [(step, key, d.position) for d in history.step(key, [r[j] for r in row])]
    return found


HEALTHY = {
    "each rank its own batches, dropout, clipping": {},
    "a learning-rate warm-up over 20 steps": {"warmup": 20},
    "no clipping, a higher learning rate": {"clip": None, "lr": 3e-2},
    "small batches (4 samples a rank)": {"batch": 4},
    "the learning rate multiplied by 10 at step 30 on every rank": {"lr_jump": 30},
    "heavy dropout (0.5)": {"dropout": 0.5},
}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", sorted(HEALTHY))
def test_healthy_data_parallel_training_raises_no_alarm(case, ranks):
    for seed in range(3):
        rows = data_parallel_statistics(ranks, 60, seed=seed, **HEALTHY[case])
        assert alarms(rows) == [], f"{case}, seed {seed}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_fed_inputs_scaled_by_40_is_named_first_at_that_step_and_no_one_before(ranks):
    for seed in range(3):
        rows = data_parallel_statistics(ranks, 30, seed=seed, scaled=(1,), scale_from=15)
        found = alarms(rows)
        assert found, f"seed {seed}: not named"
        assert found[0] == (15, "actv", 1), f"seed {seed}: {found[:3]}"
        assert all(rank == 1 and step >= 15 for step, _, rank in found), f"seed {seed}: {found}"
        # its history is not fed its faulty values: it stays named while the fault lasts
        assert {step for step, key, _ in found if key == "actv"} == set(range(15, 30))


def test_with_two_ranks_the_median_test_cannot_tell_who_and_the_history_can():
    rows = data_parallel_statistics(2, 20, scaled=(1,), scale_from=12)
    assert all(departing([r[0] for r in row], K) == [] for row in rows)  # two values: no spread to leave
    assert alarms(rows)[0] == (12, "actv", 1)


def test_two_of_four_ranks_turning_at_once_hide_from_the_median_and_not_from_their_histories():
    rows = data_parallel_statistics(4, 24, scaled=(1, 3), scale_from=12)
    assert departing([r[0] for r in rows[12]], K) == []  # half the ranks: the median's MAD widens
    named = {(key, rank) for step, key, rank in alarms(rows) if step == 12}
    assert ("actv", 1) in named and ("actv", 3) in named
    assert {rank for _, rank in named} == {1, 3}


def test_a_fault_on_every_rank_at_once_is_not_a_rank_outlier():
    rows = data_parallel_statistics(4, 24, scaled=(0, 1, 2, 3), scale_from=12)
    assert alarms(rows) == []  # the ratios did not move: every rank, not one (AnomalyTurbulence's business)


def test_the_history_is_the_bias_corrected_average_and_its_scale_the_root_mean_square_deviation():
    values = [1.0, 1.4, 0.7, 1.2, 0.9, 1.1, 1.05, 0.8, 1.3]
    history = History()
    for v in values:
        history.enter(v)
    # the same EMAs written out: s <- (1 - a) s + a x, corrected by 1 - (1 - a)^n
    total, square, means = 0.0, 0.0, []
    for n, v in enumerate(values):
        if n:
            square = (1 - DEVIATION_ALPHA) * square + DEVIATION_ALPHA * (v - means[-1]) ** 2
        total = (1 - ALPHA) * total + ALPHA * v
        means.append(total / (1 - (1 - ALPHA) ** (n + 1)))
    assert history.mean == pytest.approx(means[-1], rel=1e-12)
    spread = math.sqrt(square / (1 - (1 - DEVIATION_ALPHA) ** (len(values) - 1)))
    assert history.scale == pytest.approx(max(spread, LOG_FLOOR), rel=1e-12)
    assert history.score(history.mean + 2 * history.scale) == pytest.approx(2.0)


def test_no_test_before_the_warm_up_and_a_zero_or_non_finite_value_neither_tested_nor_entered():
    history = RankHistory(2, K)
    for _ in range(WARMUP - 1):
        assert history.step("actv", [1.0, 1.0]) == []
    assert history.step("actv", [1.0, 1000.0]) == []  # no history of WARMUP values yet
    calm = RankHistory(2, K)
    for _ in range(WARMUP):
        calm.step("actv", [1.0, 1.0])
    assert calm.step("actv", [math.nan, 1.0]) == [] and calm.step("actv", [0.0, 1.0]) == []
    assert calm.own["actv"][0].n == WARMUP  # neither entered
    (named,) = calm.step("actv", [1.0, 40.0])
    assert (named.position, named.recent, named.ratio) == (1, pytest.approx(1.0), pytest.approx(40.0))


def test_the_first_tensor_named_is_the_first_in_execution_order_that_left_its_own_history():
    own = TensorHistory(K)
    names = [("actv", "fc1.input", 0), ("actv", "fc1.output", 0), ("actv", "fc2.output", 0)]
    for v in (1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.1):
        own.enter(names, [v, 3 * v, 2 * v])
    assert own.first_departing(names, [1.0, 90.0, 80.0], upward=True) == (
        1,
        pytest.approx(own.tensors[names[1]].score(math.log(90))),
    )
    assert own.first_departing(names, [1.0, 3.0, 2.0], upward=True)[0] in (0, 1, 2)  # none departs: the most
    assert own.first_departing([("actv", "new", 0)], [5.0], upward=True) is None


def test_the_record_of_a_history_departure_says_its_own_recent_value_and_its_first_tensor():
    history = RankHistory(2, K)
    own = TensorHistory(K)
    names = [("fc1.input", 0, 0), ("fc1.output", 0, 1)]
    tensors = [("actv", n, v) for n, v, _ in names]
    for v in (1.0, 1.1, 0.95, 1.05, 1.0, 1.02, 0.98, 1.04):
        history.step("actv", [v, v * 1.1])
        own.enter(tensors, [v, 2 * v])
    (d,) = history.step("actv", [1.0, 44.0])
    mine = RankStatistics(
        9, {"actv": 44.0, "loss": math.nan, "grad": math.nan}, {"actv": Tensors(names, [40.0, 18.0])}, 1
    )
    hit = Departure(ACTIVATION, 44.0, abs(d.score), [1.0, 44.0], d.recent, 0.14, OWN_HISTORY, d)
    record = dump_record(mine, [hit], {"actv": [[1.0, 40.0], [2.0, 18.0]]}, 1, [0, 1], K, own)
    assert (record["name"], record["category"], record["basis"], record["op"]) == (
        "fc1.input",
        "actv",
        OWN_HISTORY,
        "actv_norm",
    )
    assert record["history"] == pytest.approx(d.recent) and record["tensor"]["value"] == 40.0
    assert record["message"].startswith(f"rank 1's activation norm 44 is {44.0 / d.recent:.3g} times its own recent")
    assert "while the other rank did not move with it" in record["message"]
    assert "first departing tensor: fc1.input (norm 40, its own recent" in record["message"]
