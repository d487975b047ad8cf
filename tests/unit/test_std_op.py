"""`std`, the op derived from others (msmon.stats.ops: `derived_from`): torch's sample standard
deviation (`Tensor.std()`, Bessel's correction), recorded on every path that computes its bases
(the native kernel, the torch reductions, the accelerator path's two routes) and combined
exactly across pieces (a tensor's calls, its shards, the ranks' pieces) through the norm and the
mean it is derived from, checked against plain torch's std of the whole tensor in float64."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import ALL_OPS, MLP, precision_slack, read_csv_rows, reference_stats
from msmon import TrainerMon
from msmon.stats import native
from msmon.stats.combine import combine_gathered, combine_rows
from msmon.stats.engine import batch_stats, tensor_stats
from msmon.stats.ops import with_dependencies
from msmon.stats.scalar import scalar_rows


def tensors() -> list[torch.Tensor]:
    """Spreads around non-zero means, in each float dtype, in sizes that take the batched,
    segmented, per-tensor and chunked reads, with a NaN, a one-element and a constant tensor
    (the bases are summed in float64 on every path: the squares cancel that far)."""
    gen = torch.Generator().manual_seed(3)
    with_nan = torch.randn(300, generator=gen)
    with_nan[7] = math.nan
    return [
        torch.randn(1000, 37, generator=gen) * 2 + 0.5,
        torch.randn(5, generator=gen) - 1,
        torch.randn(300_000, generator=gen) * 0.1 - 0.3,
        (torch.randn(17, generator=gen) * 3).to(torch.bfloat16),
        (torch.randn(64, 8, generator=gen) + 4).to(torch.float16),
        torch.randn(999, generator=gen, dtype=torch.float64) * 1e-3 + 1e-3,
        with_nan,
        torch.tensor([2.5]),
        torch.full((4099,), 0.37),  # constant: a spread of 0 where the squares cancel
    ]


def assert_std(got: float, t: torch.Tensor) -> None:
    want = reference_stats(t, ["min", "max", "mean", "std"])
    if math.isnan(want["std"]):
        assert math.isnan(got), (got, t.shape)
    else:
        assert got == pytest.approx(want["std"], rel=1e-9, abs=precision_slack("std", want) + 1e-15), t.dtype


@pytest.fixture(params=["kernel", "torch", "accelerator-compiled", "accelerator-foreach"])
def path(request, monkeypatch):
    """Each path that computes statistics on this machine."""
    from msmon.stats import device_path, fused_rows

    if request.param == "kernel":
        monkeypatch.setenv(native.ENV, "1")
        native.reset()
        if native.load() is None:
            pytest.fail("the native statistics did not build (a C++ compiler is a test requirement)")
    elif request.param.startswith("accelerator"):
        monkeypatch.setenv(device_path.ENV, "1")
        if request.param.endswith("foreach"):
            monkeypatch.setenv(fused_rows.ENV, "0")
        device_path.refresh()
    yield request.param
    native.reset()
    monkeypatch.delenv(device_path.ENV, raising=False)
    device_path.refresh()


def test_std_is_torchs_sample_std_on_every_path_alone_or_among_the_ops(path):
    """(The compiled route is asked for every op only: its kernels for those fields are compiled
    once for the accelerator path's own tests too.)"""
    ts = tensors()
    among = batch_stats(ts, ALL_OPS, 1e-8)
    assert among.shape == (len(ts), len(ALL_OPS))
    column = ALL_OPS.index("std")
    for i, t in enumerate(ts):
        assert_std(among[i, column].item(), t)
    if path == "accelerator-compiled":
        return
    alone = batch_stats(ts, ["std"], 1e-8)
    assert alone.shape == (len(ts), 1)
    for i, t in enumerate(ts):
        assert_std(alone[i, 0].item(), t)
        assert_std(tensor_stats(t, ["std"], 1e-8).item(), t)
    if path == "kernel":
        assert native.readable_rows() is not None  # computed from the kernel's sums, no torch reduction


def test_a_rows_columns_are_the_ops_then_the_bases_its_derived_ops_lack():
    assert with_dependencies(["std"]) == ["std", "norm", "mean"]
    assert with_dependencies(["mean", "std", "min"]) == ["mean", "std", "min", "norm"]
    assert with_dependencies(["mean", "std", "norm"]) == ["mean", "std", "norm"]
    assert with_dependencies(["norm", "min"]) == ["norm", "min"]


def test_pieces_std_combine_exactly_into_the_whole_tensors_std_through_its_bases():
    """A tensor cut in pieces (one of them empty) and, for the ranks' gather, three tensors' pieces
    over two ranks: the combined std is the whole tensor's, the bases' columns included."""
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(1000, generator=gen) * 0.2 + 3.0
    cuts = [0, 10, 10, 600, 1000]
    pieces = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    ops = with_dependencies(["std", "min"])
    rows = batch_stats(pieces, ops, 1e-8)
    counts = torch.tensor([float(p.numel()) for p in pieces])
    combined = combine_rows(rows, counts, ops)
    assert_std(combined[0].item(), whole)
    assert combined[ops.index("mean")].item() == pytest.approx(whole.double().mean().item(), rel=1e-6)

    wholes = [torch.randn(n, generator=gen) * s + m for n, s, m in ((50, 1.0, 0.0), (7, 0.5, -2.0), (300, 3.0, 1.0))]
    halves = [[w[: len(w) // 3], w[len(w) // 3 :]] for w in wholes]
    by_rank = torch.stack([batch_stats([h[rank] for h in halves], ops, 1e-8) for rank in (0, 1)])
    numels = torch.tensor([[float(h[rank].numel()) for h in halves] for rank in (0, 1)])
    gathered = combine_gathered(by_rank, numels, ops)
    for w, row in zip(wholes, gathered):
        assert_std(row[0].item(), w)
    with pytest.raises(ValueError, match="combine only with its bases"):
        combine_rows(rows[:, :2], counts, ["std", "min"])


def test_the_std_of_one_element_is_0_and_of_a_nan_is_nan():
    """torch leaves one element's sample std undefined (NaN); in a row a NaN says the tensor held
    one, so msmon writes 0: an alert, the non-finite origin or on_nan's stop see a sound tensor."""
    rows = scalar_rows(torch.tensor([0.25, -1.0, math.nan]), with_dependencies(["std"]), 1e-8)
    assert rows[:2, 0].tolist() == [0.0, 0.0] and math.isnan(rows[2, 0])
    assert rows[:2, 1:].tolist() == [[0.25, 0.25], [1.0, -1.0]]
    assert tensor_stats(torch.tensor([3.0]), ["std"], 1e-8).tolist() == [0.0]


@pytest.mark.parametrize("ops", [["std"], ["mean", "std", "norm"]])
def test_a_monitored_run_writes_the_ops_asked_std_among_them_equal_to_torchs_std(write_config, output_dir, ops):
    """The rows carry the norm and the mean std is derived from; the CSV holds the ops asked,
    those two only where they are asked, in the order asked."""
    config = write_config(
        {"wg_distribution": True, "param_distribution": True, "format": "csv", "ops": ops, "ndigits": 15}
    )
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer)
    model(torch.randn(6, 8)).pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    monitor.close()
    reduced = read_csv_rows(Path(monitor.log_dir), "grad_reduced")
    before = read_csv_rows(Path(monitor.log_dir), "param_origin")
    assert reduced and list(reduced[0])[-len(ops) :] == ops
    for rows, truth in ((reduced, grads), (before, weights)):
        assert sorted(row["name"] for row in rows) == sorted(truth)
        for row in rows:
            assert_std(float(row["std"]), truth[row["name"]])
