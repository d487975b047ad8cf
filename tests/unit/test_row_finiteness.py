"""A statistics row tells whether its tensor was finite exactly as reading the tensor does."""

from __future__ import annotations

import pytest
import torch

from msmon.records.rows import RowKey
from msmon.runtime.buffer import StepBuffer
from msmon.runtime.row_finiteness import RowFiniteness, row_finiteness
from msmon.stats import native
from msmon.stats.engine import tensor_stats

CASES = {
    "finite": [1.0, -2.0, 0.0],
    "nan": [1.0, float("nan"), 3.0],
    "+inf": [float("inf"), 1.0, 2.0],
    "-inf": [1.0, float("-inf"), 2.0],
    "nan and inf": [float("nan"), float("inf"), float("-inf")],
    "huge but finite": [3.0e38, 3.0e38, -1.0],  # a float32 sum overflows; the tensor is finite
}


@pytest.mark.parametrize("ops", [["norm", "min", "max"], ["mean", "nans", "infs"], ["max", "infs", "nans", "min"]])
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_row_says_finite_exactly_when_every_element_is(ops, kernel, dtype, monkeypatch):
    if kernel:  # the session's kernel (a C++ compiler is a test requirement)
        monkeypatch.setenv(native.ENV, "1")
        native.reset()
        assert native.load() is not None
    test = RowFiniteness.for_ops(ops)
    assert test is not None
    tensors = {name: torch.tensor(values * 300, dtype=dtype) for name, values in CASES.items()}
    rows = torch.stack([tensor_stats(t, ops, 1e-8) for t in tensors.values()])
    told = test.flags(rows).tolist()
    assert told == [bool(torch.isfinite(t).all()) for t in tensors.values()]


def test_ops_that_cannot_tell_give_no_test():
    assert RowFiniteness.for_ops(["norm", "mean", "zeros"]) is None
    assert RowFiniteness.for_ops(["min", "nans"]) is None
    assert row_finiteness(["norm"]) is None and row_finiteness(["min", "max"]) is not None


def test_flags_told_by_rows_and_read_flags_keep_their_order_in_the_step():
    ops = ["min", "max"]
    test = RowFiniteness.for_ops(ops)
    buffer = StepBuffer()
    expected = []
    for i, values in enumerate([[1.0], [float("nan")], [2.0], [float("inf")], [3.0]]):
        t = torch.tensor(values)
        key = RowKey("actv", f"m{i}.output", 0, 0)
        if i % 2:
            buffer.add_flag(key, torch.isfinite(t.sum()))
        else:
            buffer.add_flag_of_row(key, tensor_stats(t, ops, 1e-8), test)
        expected.append(bool(torch.isfinite(t).all()))
    for i in range(3):  # a run of rows after a run of read flags
        buffer.add_flag_of_row(RowKey("actv", f"r{i}", 0, 0), tensor_stats(torch.tensor([-float(i)]), ops, 1e-8), test)
        expected.append(True)
    keys, _, _, flag_keys, flags = buffer.take()
    assert flags is not None and flags.dtype == torch.bool
    assert flags.tolist() == expected
    assert [k.name for k in flag_keys][:5] == [f"m{i}.output" for i in range(5)]
    assert buffer.take()[4] is None
