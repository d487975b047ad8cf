"""The compiled one-pass kernel of the accelerator path (msmon.stats.fused_rows, block_rows,
fused_batch): rows cover every element of every tensor once, the generated kernel gives what
plain eager torch gives over the same columns (values outside a row's columns, NaN included,
never leak in), a user's TorchDispatchMode neither stops it nor sees it, and a failure to
compile is said once and leaves the other route to compute the same rows."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msmon.stats import block_rows, fused_batch, fused_rows
from msmon.stats.block_rows import SKIP
from msmon.stats.engine import batch_stats
from msmon.stats.flat_layout import GAP
from msmon.stats.fused_rows import BLOCK

OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]


@pytest.fixture(autouse=True)
def accelerator_path(device_path, monkeypatch):
    monkeypatch.delenv(fused_rows.ENV, raising=False)


def covered(pieces: list[tuple[int, int]], size: int, tail_in_place: bool) -> dict[int, list[int]]:
    """For each tensor, the chunk positions its rows cover, in the order the rows give them."""
    rows = block_rows.block_rows(tuple(pieces), size, tail_in_place)
    seen: dict[int, list[int]] = {}
    assert len(rows.main_tensors) == rows.main_rows and rows.main_rows != 1
    for block, tensor in enumerate(rows.main_tensors):  # read whole
        if tensor != SKIP:
            seen.setdefault(tensor, []).extend(range(block * BLOCK, (block + 1) * BLOCK))
    assert len(rows.boundary_blocks) != 1, "a matrix of one row would specialise the compiled code"
    for block, lo, hi, tensor in zip(rows.boundary_blocks, rows.boundary_lo, rows.boundary_hi, rows.boundary_tensors):
        if tensor != SKIP:
            seen.setdefault(tensor, []).extend(range(block * BLOCK + lo, block * BLOCK + hi))
    assert all(p < size for positions in seen.values() for p in positions), "no position past the chunk"
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_rows_cover_every_element_of_every_tensor_once_and_no_gap(seed):
    rng = random.Random(seed)
    pieces: list[tuple[int, int]] = []
    tensor = 0
    for _ in range(rng.randint(1, 12)):
        length = rng.choice([1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, rng.randint(1, 5 * BLOCK)])
        if rng.random() < 0.2:
            pieces.append((GAP, length))
        else:
            pieces.append((tensor, length))
            tensor += 1
    size = sum(length for _, length in pieces)
    for tail_in_place in (True, False):
        seen = covered(pieces, size, tail_in_place)
        start = 0
        for row, length in pieces:
            if row != GAP:
                assert sorted(seen.pop(row)) == list(range(start, start + length))
            start += length
        assert not seen, "a gap's elements are nobody's"


def masked_reference(x: torch.Tensor, bounds: torch.Tensor, threshold: float) -> list[list[float]]:
    """Plain torch, row by row, over each row's columns only, in float64, in FIELDS' order."""
    out = []
    for row, (lo, hi) in zip(x, bounds.tolist()):
        v = row[lo:hi].double()
        if v.numel() == 0:
            values = dict(sq=0.0, max=-math.inf, negmax=-math.inf, sum=0.0, zeros=0.0, nans=0.0, infs=0.0)
        else:
            values = dict(
                sq=(v * v).sum().item(),
                max=v.max().item(),
                negmax=(-v).max().item(),
                sum=v.sum().item(),
                zeros=float((v.abs() < threshold).sum()),
                nans=float(torch.isnan(v).sum()),
                infs=float(torch.isinf(v).sum()),
            )
        out.append([values[name] for name in fused_rows.FIELDS])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_generated_kernel_gives_each_whole_rows_values(dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, BLOCK, generator=gen).to(dtype)
    x[0, 3] = math.nan
    x[1, 10] = -math.inf
    x[2, 100:200] = 0.0
    got = fused_rows.row_values(x, None, torch.tensor(1e-3))
    assert got is not None
    want = masked_reference(x, torch.tensor([[0, BLOCK]] * 5), 1e-3)
    for g_row, w_row in zip(got.tolist(), want):
        for name, g, w in zip(fused_rows.FIELDS, g_row, w_row):
            if name in ("sq", "sum") and not math.isnan(w):
                assert g == pytest.approx(w, rel=1e-5, abs=1e-5), name
            elif math.isnan(w):
                assert math.isnan(g), name
            else:
                assert g == w, (name, g, w)


@pytest.mark.parametrize(
    "ops, fields",
    [
        (["norm", "min", "max", "mean", "zeros", "nans"], ("sq", "sum", "zeros", "nans", "max", "negmax")),
        (["max"], ("sq", "max")),  # the sum of squares is min's and max's NaN witness
        (["nans", "infs"], ("nans", "infs")),
        (["mean"], ("sum",)),
    ],
)
def test_the_pass_computes_the_fields_the_ops_read_and_no_other(ops, fields):
    assert fused_batch.fields_of_ops(ops) == fields


@pytest.mark.parametrize("fields", [("sq", "max", "negmax"), ("nans",), ("sum", "zeros", "max")], ids=str)
def test_a_kernel_of_some_fields_gives_those_columns_of_the_whole_kernel_and_nothing_else(fields):
    x = torch.randn(4, BLOCK, generator=torch.Generator().manual_seed(3))
    x[1, 7] = math.nan
    threshold = torch.tensor(1e-3)
    bounds = torch.tensor([[0, BLOCK], [3, 500], [0, 0], [10, 11]])
    for rows_bounds in (None, bounds):
        every = fused_rows.row_values(x, rows_bounds, threshold)
        some = fused_rows.row_values(x, rows_bounds, threshold, fields)
        assert every is not None and some is not None and some.shape == (4, len(fields))
        columns = [fused_rows.FIELDS.index(name) for name in fields]
        assert torch.allclose(some, every[:, columns], rtol=1e-6, equal_nan=True)


def test_ops_that_read_no_field_compile_nothing_at_attach_and_leave_the_pass_on(monkeypatch):
    monkeypatch.setattr(fused_rows, "_failed", False)
    fused_rows.prepare([torch.zeros(4, 4)], ())  # e.g. only ops registered with their own reduction
    assert fused_rows.usable(torch.device("cpu"))


def test_many_field_sets_and_dtypes_in_one_process_keep_the_compiled_pass_on(monkeypatch):
    """Each field set's kernel has a code object of its own: dynamo's limit of eight graphs per
    code object (past it fullgraph=True fails) is never reached by sets times dtypes."""
    monkeypatch.setattr(fused_rows, "_failed", False)
    sets = [("sq",), ("sum",), ("zeros",), ("nans",), ("infs",), ("max",)]
    for dtype in (torch.float32, torch.bfloat16):
        for fields in sets:
            x = torch.randn(3, BLOCK).to(dtype)
            got = fused_rows.row_values(x, None, torch.tensor(1e-3), fields)
            assert got is not None and got.shape == (3, 1), (dtype, fields)
    assert fused_rows.usable(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_generated_kernel_gives_each_rows_values_over_its_columns_only(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, BLOCK, generator=gen).to(dtype)
    x[0, 3] = math.nan  # outside row 0's columns: must not count
    x[1, 10] = math.inf  # inside
    x[2, 100:200] = 0.0
    x[3, 900] = math.nan  # inside
    x[4, :] = math.nan  # a row with no columns at all
    bounds = torch.tensor([[5, 0, 50, 0, 0, 1], [BLOCK, 20, 300, BLOCK, 0, 2]]).t().contiguous()
    got = fused_rows.row_values(x, bounds, torch.tensor(1e-3))
    assert got is not None and got.shape == (6, len(fused_rows.FIELDS))
    want = masked_reference(x, bounds, 1e-3)
    for g_row, w_row, nan_inside in zip(got.tolist(), want, [False, False, False, True, False, False]):
        for name, g, w in zip(fused_rows.FIELDS, g_row, w_row):
            if nan_inside and name in ("sq", "max", "negmax", "sum"):
                assert math.isnan(g), name
            elif name in ("sq", "sum"):
                assert g == pytest.approx(w, rel=1e-5, abs=1e-5), name
            else:
                assert g == w, (name, g, w)


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_users_dispatch_mode_neither_stops_nor_sees_the_compiled_kernel():
    ts = [torch.randn(3000), torch.randn(77), torch.randn(40, 40)]
    expected = batch_stats(ts, OPS, 1e-3)
    before = fused_rows.launched_kernels()
    with Counting() as mode:
        got = batch_stats(ts, OPS, 1e-3)
    assert fused_rows.launched_kernels() > before, "the compiled kernel ran under the user's mode"
    assert torch.equal(got, expected)
    assert mode.ops > 0  # the user's mode still sees msmon's eager ops around it, and works


def test_a_failure_to_compile_is_said_once_and_the_other_route_gives_the_same_rows(monkeypatch, caplog):
    ts = [torch.randn(5000), torch.randn(10), torch.randn(64, 3)]
    ts[0][4] = math.nan
    expected = batch_stats(ts, OPS, 1e-3)

    def refuse(masked: bool, fields: tuple[str, ...]) -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(fused_rows, "_function", refuse)  # what torch.compile raises on a machine without one
    monkeypatch.setattr(fused_rows, "_failed", False)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        first = batch_stats(ts, OPS, 1e-3)
        second = batch_stats(ts, OPS, 1e-3)
    said = [r for r in caplog.records if "compiled statistics pass is off" in r.getMessage()]
    assert len(said) == 1 and "no C++ compiler found" in said[0].getMessage()
    assert not fused_rows.usable(torch.device("cpu"))
    for rows in (first, second):
        assert torch.allclose(rows, expected, rtol=1e-5, equal_nan=True)


def test_msmon_compiled_stats_0_keeps_the_compiled_kernel_off(monkeypatch):
    monkeypatch.setenv(fused_rows.ENV, "0")
    before = fused_rows.launched_kernels()
    rows = batch_stats([torch.randn(3000), torch.randn(5)], OPS, 1e-3)
    assert fused_rows.launched_kernels() == before
    assert rows.shape == (2, len(OPS))


def test_attach_compiles_the_kernels_for_the_models_dtypes_before_the_first_step(monkeypatch, write_config, output_dir):
    from msmon import TrainerMon

    monkeypatch.setattr(fused_rows, "KERNELS_PER_CALL", {})  # as in a fresh process
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config({"wg_distribution": True, "format": "csv"}), params_have_main_grad=False)
    monitor.set_monitor(model, optimizer)
    try:
        compiled = set(fused_rows.KERNELS_PER_CALL)
        fields = fused_batch.fields_of_ops(monitor.ops)  # what the configured ops read, and no more
        assert "infs" not in fields and "sq" in fields
        for dtype in (torch.bfloat16, torch.float32):  # the parameters', and float32 (moments, staged sums)
            assert {(dtype, "cpu", False, fields), (dtype, "cpu", True, fields)} <= compiled
        before = fused_rows.launched_kernels()
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        assert fused_rows.launched_kernels() > before, "the step's statistics took the compiled pass"
        assert set(fused_rows.KERNELS_PER_CALL) == compiled, "the step compiled nothing more"
    finally:
        monitor.close()


def test_where_alignment_matters_the_first_compile_is_for_any_alignment_and_real_calls_reuse_it(monkeypatch):
    """On a GPU the first call compiles on an input at an odd offset (so Inductor never copies a
    misaligned span later); the real input then runs the same code: no second compile."""
    monkeypatch.setattr(fused_rows, "_alignment_matters", lambda device: True)
    monkeypatch.setattr(fused_rows, "KERNELS_PER_CALL", {})
    monkeypatch.setattr(fused_rows, "_compiled", {})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x = torch.randn(4, BLOCK)
    bounds = torch.tensor([[0, BLOCK], [5, 9], [0, 0], [0, 1]])
    got = fused_rows.row_values(x, bounds, torch.tensor(1e-3))
    assert got is not None
    sums = [x[0].sum().item(), x[1, 5:9].sum().item(), 0.0, x[3, :1].item()]
    assert got[:, fused_rows.FIELDS.index("sum")].tolist() == pytest.approx(sums, rel=1e-5)
    whole = fused_rows.row_values(x, None, torch.tensor(1e-3))
    assert whole is not None and whole[:, 0].tolist() == pytest.approx((x * x).sum(1).tolist(), rel=1e-5)
    counters = torch._dynamo.utils.counters["stats"]
    assert counters["unique_graphs"] == 2, dict(counters)  # one per kernel: the unaligned first call's


def test_msmons_own_compiled_graphs_are_not_taken_for_the_users_torch_compile(
    write_config, output_dir, caplog, monkeypatch
):
    """The activation collector tells a user whose modules ran only inside torch.compile'd graphs
    from one who called none: msmon's own compiled statistics must not count as the user's."""
    import torch.nn.functional as F

    from msmon import TrainerMon

    ts = [torch.randn(3000), torch.randn(10)]
    torch._dynamo.reset()
    monkeypatch.setattr(fused_rows, "_compiled", {})
    monkeypatch.setattr(fused_rows, "KERNELS_PER_CALL", {})
    monkeypatch.setattr(fused_rows, "_others", 0)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batch_stats(ts, OPS, 1e-3)  # msmon's graphs are built in this process
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config({"xy_distribution": True, "format": "csv"}), params_have_main_grad=False)
    monitor.set_monitor(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        F.linear(torch.randn(3, 8), model[0].weight, model[0].bias).sum().backward()  # no module called
        optimizer.step()
        monitor.close()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "torch.compile" in m], messages
    assert [m for m in messages if "trained without calling any monitored module" in m]


def test_where_torch_compile_is_switched_off_the_foreach_route_runs(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    before = fused_rows.launched_kernels()
    ts = [torch.randn(3000), torch.randn(5)]
    rows = batch_stats(ts, OPS, 1e-3)
    assert fused_rows.launched_kernels() == before
    assert rows[0, 0].item() == pytest.approx(ts[0].double().norm().item(), rel=1e-5)
