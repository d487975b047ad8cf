"""A model that is one bare module (the model IS an nn.Linear) has its activations recorded, under
the empty module name as msprobe names the root; and no log line blames torch.compile for
activations that are missing when nothing was compiled."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from conftest import assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon

OPS = ["norm", "min", "max", "mean"]
CONFIG = {"xy_distribution": True, "nan_origin": True, "format": "csv", "ops": OPS}


def test_a_model_that_is_one_linear_gets_its_input_output_and_gradient_rows(write_config, output_dir, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    truth = []
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for _ in range(2):
            x = torch.randn(3, 8)
            y = model(x)
            y.retain_grad()
            y.square().mean().backward()
            truth.append({".input": x, ".output": y.detach().clone(), "grad": y.grad.clone()})
            optimizer.step()
            optimizer.zero_grad()
        mon.close()
    directory = rank_dir(output_dir)
    actv = read_csv_rows(directory, "actv")
    assert sorted((r["step"], r["name"]) for r in actv) == [(s, n) for s in "01" for n in (".input", ".output")]
    for row in actv:
        assert_row_matches(row, reference_stats(truth[int(row["step"])][row["name"]], OPS))
    grads = read_csv_rows(directory, "actv_grad")  # the input needs no gradient: the output's only
    assert [(r["step"], r["name"]) for r in grads] == [("0", ".output"), ("1", ".output")]
    for row in grads:
        assert_row_matches(row, reference_stats(truth[int(row["step"])]["grad"], OPS))
    assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]


def test_a_model_whose_modules_are_never_called_is_not_said_to_be_compiled(write_config, output_dir, caplog):
    """The script uses the model's parameters directly (F.linear): no monitored module runs, and
    nothing was compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    layer = model[0]
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for _ in range(2):
            F.linear(torch.randn(3, 8), layer.weight, layer.bias).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        mon.close()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "torch.compile" in m]
    assert [m for m in messages if "trained without calling any monitored module" in m] == [
        "msmon[rank 0]: step 0 trained without calling any monitored module (1 of them, e.g. '0'); "
        "no activation was recorded"
    ]
