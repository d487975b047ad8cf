"""A new statistic is one declaration: an op registered in the op table (here the mean of absolute
values, for this test only) is accepted by the config, computed on every path, combined from
pieces, and written to the CSV, to TensorBoard and into `msmon db`, with nothing else wired."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.config import ConfigError, load_config
from msmon.stats import native, ops
from msmon.stats.combine import combine_rows
from msmon.stats.engine import batch_stats, tensor_stats
from msmon.stats.scalar import scalar_rows

ABS_MEAN = ops.Op(
    "abs_mean",
    "abs_mean",
    "abs_mean",
    True,  # the sum of |x| below, divided by the element count
    "average",
    ops.count_weighted_mean,
    compute=lambda x, acc: x.abs().sum(dtype=acc),
)
OPS = ["norm", "abs_mean", "nans"]
EPS = 1e-8


@pytest.fixture
def abs_mean() -> Iterator[ops.Op]:
    """The op in the table for one test, and out of it again after."""
    ops.register(ABS_MEAN)
    try:
        yield ABS_MEAN
    finally:
        ops.unregister(ABS_MEAN.name)


def reference(t: torch.Tensor) -> float:
    """The mean of absolute values in float64, by plain torch."""
    return float(t.detach().double().abs().mean())


def test_the_config_accepts_a_registered_op_and_no_longer_once_it_is_taken_out(write_config):
    path = write_config({"wg_distribution": True, "ops": OPS})
    with pytest.raises(ConfigError, match="unknown op 'abs_mean'"):
        load_config(path)
    ops.register(ABS_MEAN)
    try:
        assert load_config(path).ops == OPS
    finally:
        ops.unregister(ABS_MEAN.name)
    with pytest.raises(ConfigError, match="unknown op 'abs_mean'"):
        load_config(path)


def test_a_registration_the_engine_could_not_compute_or_that_shadows_an_op_is_refused():
    with pytest.raises(ValueError, match="already in the table"):
        ops.register(ops.BY_NAME["norm"])
    with pytest.raises(ValueError, match="no compute is given"):
        ops.register(dataclasses.replace(ABS_MEAN, compute=None))
    with pytest.raises(ValueError, match="kind"):
        ops.register(dataclasses.replace(ABS_MEAN, kind="mean"))
    assert "abs_mean" not in ops.OPS and "abs_mean" not in ops.BY_NAME


@pytest.mark.parametrize("kernel", ["1", "0", "accelerator path"])
def test_a_registered_op_is_computed_beside_the_table_ops_on_the_native_and_the_torch_path(
    abs_mean, kernel, monkeypatch, request
):
    if kernel == "accelerator path":  # MSMON_DEVICE_PATH=1: stats.multi_tensor, no kernel
        request.getfixturevalue("device_path")
        kernel = "0"
    monkeypatch.setenv(native.ENV, kernel)  # the conftest's fixture resets the kernel after the test
    native.reset()
    assert (native.load() is not None) == (kernel == "1"), "the kernel is built (a C++ compiler is a test requirement)"
    g = torch.Generator().manual_seed(3)
    # small tensors (reduced as segments of one buffer), larger ones, one over a CPU chunk, other dtypes
    tensors = [torch.randn(n, generator=g) for n in (3, 5, 7, 11, 5000, 300_000)]
    tensors += [torch.randn(64, generator=g).to(torch.float16), torch.arange(-4, 6), torch.randn(6, 5).t()]
    rows = batch_stats(tensors, OPS, EPS)
    for t, row in zip(tensors, rows):
        one = tensor_stats(t, OPS, EPS)
        for got in (row, one):
            assert got[1].item() == pytest.approx(reference(t), rel=1e-5)
            assert got[0].item() == pytest.approx(float(t.double().norm()), rel=1e-5)
            assert got[2].item() == 0
    # the table's own ops keep their values where the kernel reads them without the new op
    assert torch.allclose(rows[:, [0, 2]], batch_stats(tensors, ["norm", "nans"], EPS), rtol=1e-6)


def test_a_registered_op_combines_from_pieces_by_its_rule_and_gives_scalar_rows(abs_mean):
    whole = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    pieces = [whole[:100], whole[100:100], whole[100:]]  # an empty piece is left out
    rows = batch_stats(pieces, OPS, EPS)
    combined = combine_rows(rows, torch.tensor([p.numel() for p in pieces]), OPS)
    assert combined[1].item() == pytest.approx(reference(whole), rel=1e-5)
    scalars = torch.tensor([-2.5, 0.0, 3.0])
    assert scalar_rows(scalars, OPS, EPS)[:, 1].tolist() == [2.5, 0.0, 3.0]


def tensorboard_values(directory, suffix: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.endswith(suffix)}


def test_a_registered_op_is_in_the_csv_in_tensorboard_and_in_msmon_db(abs_mean, write_config, output_dir, tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {"wg_distribution": True, "mv_distribution": True, "format": ["csv", "tensorboard"], "ops": OPS}
    mon = TrainerMon(write_config(config), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    grads, moments, squares = [], [], []
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        moments.append({n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()})
        squares.append({n: optimizer.state[p]["exp_avg_sq"].clone() for n, p in model.named_parameters()})
        optimizer.zero_grad()
    mon.close()
    out = rank_dir(output_dir)

    csv_values, expected_values = {}, {}
    categories = {"grad_unreduced": grads, "grad_reduced": grads, "exp_avg": moments, "exp_avg_sq": squares}
    for category, captured in categories.items():
        rows = read_csv_rows(out, category)
        assert len(rows) == 2 * 4 and all(list(row)[-3:] == OPS for row in rows), category
        for row in rows:
            expected = reference(captured[int(row["step"])][row["name"]])
            assert float(row["abs_mean"]) == pytest.approx(expected, rel=1e-5, abs=1.5e-6), (category, row)
            csv_values[(category, row["name"], int(row["step"]))] = float(row["abs_mean"])
            expected_values[(category, row["name"], int(row["step"]))] = expected

    tags = tensorboard_values(out, "_abs_mean")
    assert sum(len(events) for events in tags.values()) == len(csv_values) == 4 * 2 * 4
    for tag, events in tags.items():
        display, _, what = tag.split("/")
        category, name = what[: -len("_abs_mean")], display.split(":", 1)[1]
        for step, value in events:
            assert value == pytest.approx(expected_values[(category, name, step)], rel=1e-5, abs=1e-7), tag

    import duckdb
    from click.testing import CliRunner

    from msmon.launcher.cli import main

    database = str(tmp_path / "run.duckdb")
    result = CliRunner().invoke(main, ["db", "-d", str(output_dir), "-o", database, "--no-progress"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(database, read_only=True)
    try:
        stored = con.execute("SELECT category, name, step, value FROM metrics WHERE op = 'abs_mean'").fetchall()
    finally:
        con.close()
    assert {(c, n, s): v for c, n, s, v in stored} == csv_values
    assert not any(math.isnan(v) for v in csv_values.values())
