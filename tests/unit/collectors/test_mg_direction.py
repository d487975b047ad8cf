"""mg_direction: the share of each parameter's elements whose gradient has the sign of Adam's
momentum before the update, checked against a direct plain-torch computation."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from conftest import ALL_OPS, MLP, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.config import ConfigError, parse_config
from msmon.stats.signs import sign_matches


def direct_share(grad: torch.Tensor, exp_avg: torch.Tensor) -> float:
    g, m = grad.double(), exp_avg.double()
    if torch.isnan(g).any() or torch.isnan(m).any():
        return math.nan
    return float((torch.sign(g) == torch.sign(m)).double().mean())


def train_capturing(model, optimizer, steps, poison_last=False):
    """Train; before each update, the direct share of every parameter that has a momentum."""
    expected = []
    for step in range(steps):
        model(torch.randn(6, 8)).square().mean().backward()
        if poison_last and step == steps - 1:
            with torch.no_grad():
                model.fc2.bias.grad[0] = math.nan
        shares = {}
        for name, p in model.named_parameters():
            state = optimizer.state.get(p)
            if state and "exp_avg" in state:
                shares[name] = direct_share(p.grad, state["exp_avg"])
        expected.append(shares)
        optimizer.step()
        optimizer.zero_grad()
    return expected


def test_mg_direction_equals_the_direct_share_of_matching_signs_in_other_csv(write_config, output_dir):
    torch.manual_seed(0)
    model = MLP()  # ReLU leaves dead units: exact-zero gradients, equal to a zero momentum
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(
        write_config({"mg_direction": True, "format": "csv", "ops": ALL_OPS, "ndigits": 15}),
        params_have_main_grad=False,
    )
    mon.set_monitor(model, optimizer)
    expected = train_capturing(model, optimizer, 5)
    mon.close()

    rows = read_csv_rows(rank_dir(output_dir), "other")  # where msprobe writes mg_direction
    assert {(int(r["step"]), r["name"]) for r in rows} == {(s, n) for s in range(1, 5) for n in expected[1]}
    assert any(0.0 < v < 1.0 for shares in expected[1:] for v in shares.values())
    for row in rows:
        share = expected[int(row["step"])][row["name"]]
        assert float(row["mean"]) == pytest.approx(share, abs=1e-15)  # ops of the one-element share
        assert float(row["min"]) == float(row["max"]) == float(row["norm"]) == float(row["mean"])
        assert (float(row["zeros"]), float(row["nans"]), float(row["infs"])) == (float(share == 0), 0.0, 0.0)


def test_the_first_step_has_no_momentum_and_writes_no_row(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    mon = TrainerMon(write_config({"mg_direction": True, "format": "csv"}), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    train_capturing(model, optimizer, 1)
    mon.close()
    assert read_csv_rows(rank_dir(output_dir), "other") == []


def test_mg_direction_tags_follow_msprobe_in_tensorboard(write_config, output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(1)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(
        write_config({"mg_direction": True, "format": "tensorboard", "ops": ["norm", "mean"]}),
        params_have_main_grad=False,
    )
    mon.set_monitor(model, optimizer)
    expected = train_capturing(model, optimizer, 3)
    mon.close()
    acc = EventAccumulator(str(rank_dir(output_dir)), size_guidance={"scalars": 0})
    acc.Reload()
    tag = "0:fc1.weight/rank0/mg_direction_mean"
    assert {t for t in acc.Tags()["scalars"] if "mg_direction" in t} == {
        f"0:{n}/rank0/mg_direction_{op}" for n in expected[1] for op in ("norm", "mean")
    }
    assert [(e.step, e.value) for e in acc.Scalars(tag)] == [
        (s, pytest.approx(expected[s]["fc1.weight"], rel=1e-6)) for s in (1, 2)
    ]


def test_a_nan_gradient_makes_its_share_nan(write_config, output_dir):
    torch.manual_seed(2)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = TrainerMon(write_config({"mg_direction": True, "format": "csv"}), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    expected = train_capturing(model, optimizer, 3, poison_last=True)
    mon.close()
    last = {r["name"]: float(r["mean"]) for r in read_csv_rows(rank_dir(output_dir), "other") if r["step"] == "2"}
    assert math.isnan(last["fc2.bias"])  # torch.sign(nan) is 0: a plain comparison would hide it
    assert last["fc1.weight"] == pytest.approx(expected[2]["fc1.weight"], abs=1e-6)


def test_sign_counts_are_exact_for_large_mixed_dtype_and_batched_tensors():
    torch.manual_seed(3)
    sizes = [3, 17, 64, 100, 4096, 5000, (1 << 18) + 7]  # segmented, one by one, chunked
    grads = [torch.randn(n) for n in sizes]
    moments = [torch.randn(n) for n in sizes]
    for g, m in zip(grads, moments):
        g[::5] = 0.0
        m[::7] = 0.0
    grads[2] = grads[2].bfloat16()
    counts = sign_matches(grads, moments)
    for count, g, m in zip(counts.tolist(), grads, moments):
        assert count == float((torch.sign(g.double()) == torch.sign(m.double())).sum())
    # the counts of the pieces of a split tensor add up to the whole tensor's
    g, m = grads[-1], moments[-1]
    cuts = [0, 1000, 1000, 200_000, g.numel()]
    pieces = sign_matches([g[a:b] for a, b in zip(cuts, cuts[1:])], [m[a:b] for a, b in zip(cuts, cuts[1:])])
    assert float(pieces.sum()) == counts[-1]


def test_mg_direction_is_validated_as_a_bool_and_msprobes_checked_name_has_no_effect(caplog):
    with pytest.raises(ConfigError, match="mg_direction: expected true or false"):
        parse_config({"mg_direction": "yes"})  # msprobe checks another key, so any value switches it on there
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    cfg = parse_config({"mg_distribution": True})
    assert not cfg.mg_direction
    assert any("'mg_direction'" in r.getMessage() for r in caplog.records)
