"""The statistics engine: values equal independently computed ones (float64 on the host),
counts are exact, every dtype and size path (whole, chunked, non-contiguous) agrees."""

from __future__ import annotations

import math

import pytest
import torch

from msmon.stats.combine import combine_rows
from msmon.stats.engine import batch_stats, tensor_stats
from msmon.stats.inputs import zero_threshold
from msmon.stats.reductions import CHUNK

ALL_OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
EPS = 1e-8
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def reference(t: torch.Tensor, ops=ALL_OPS, eps: float = EPS) -> list[float]:
    """Each statistic straight from its definition, in float64."""
    x = t.detach().to(torch.float64).flatten()
    values = {
        "norm": float(torch.sqrt((x * x).sum())),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.sum() / x.numel()),
        "zeros": int((x.abs() < eps).sum()) / x.numel(),
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
    }
    return [values[op] for op in ops]


def assert_row(row: torch.Tensor, t: torch.Tensor, ops=ALL_OPS, eps: float = EPS) -> None:
    """min, max, zeros, nans, infs exactly; norm and mean (float32 sums) within float32
    summation error: relative for the norm, relative to mean(|x|) for the mean."""
    assert row.dtype == torch.float64
    expected = reference(t, ops, eps)
    x = t.detach().to(torch.float64).flatten()
    scale = float(x[torch.isfinite(x)].abs().mean()) if x.numel() else 0.0
    for op, got, want in zip(ops, row.tolist(), expected):
        if math.isnan(want):
            assert math.isnan(got), op
        elif op == "norm" and math.isfinite(want):
            assert got == pytest.approx(want, rel=1e-5), op
        elif op == "mean" and math.isfinite(want):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5 * scale), op
        else:
            assert got == want, op


def sample(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like values with exact zeros and values straddling eps planted in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64) * 1e-3
    x[::11] = 0.0
    x[1::13] = 3e-9 * torch.sign(torch.randn(x[1::13].shape, generator=gen, dtype=torch.float64))
    x[2::17] = 2e-8
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("numel", [1, 1000, CHUNK, 2 * CHUNK + 123])
def test_statistics_equal_float64_reference_for_every_dtype_and_size(dtype, numel):
    t = sample(dtype, numel)
    assert_row(tensor_stats(t, ALL_OPS, EPS), t)


def test_non_contiguous_tensors_give_the_same_statistics_as_their_copies():
    for shape in [(300, 200), (CHUNK // 64, 130)]:  # below and above one chunk
        base = sample(torch.float32, shape[0] * shape[1], seed=3).view(shape)
        view = base.t()
        assert not view.is_contiguous()
        exact = [ALL_OPS.index(op) for op in ("min", "max", "zeros", "nans", "infs")]
        assert torch.equal(
            tensor_stats(view, ALL_OPS, EPS)[exact], tensor_stats(view.contiguous(), ALL_OPS, EPS)[exact]
        )
        assert_row(tensor_stats(view, ALL_OPS, EPS), view)


def test_zeros_compare_with_eps_exactly_in_every_dtype():
    for dtype in FLOAT_DTYPES:
        threshold = zero_threshold(EPS, dtype)
        below = torch.nextafter(torch.tensor(threshold, dtype=dtype), torch.tensor(0.0, dtype=dtype))
        t = torch.tensor([0.0, threshold, -threshold], dtype=dtype)
        t = torch.cat([t, below.view(1), -below.view(1)])
        # |x| < eps as real numbers: 0 and the value just below the threshold always are
        expected = [float(abs(v)) < EPS for v in t.to(torch.float64)]
        row = tensor_stats(t, ["zeros"], EPS)
        assert row.item() == sum(expected) / len(expected), dtype


def test_float16_counts_its_exact_zeros_although_eps_is_below_its_resolution():
    t = torch.tensor([0.0, 0.0, 6e-8, 1.0, -0.0], dtype=torch.float16)
    assert tensor_stats(t, ["zeros"], EPS).item() == 3 / 5


def test_float32_value_nearest_eps_is_below_eps_and_counts_as_zero():
    just_below = torch.tensor(EPS, dtype=torch.float32)  # 9.99999993922529e-09 < 1e-8
    assert float(just_below) < EPS
    assert tensor_stats(just_below.view(1), ["zeros"], EPS).item() == 1.0


@pytest.mark.parametrize("numel", [7, 5000, 2 * CHUNK + 5])
def test_nan_and_inf_counts_are_exact(numel):
    t = sample(torch.float32, numel, seed=1)
    t[3] = math.nan
    t[numel - 2] = math.inf
    t[-1] = -math.inf
    if numel > 10:
        t[5] = math.nan
    row = tensor_stats(t, ALL_OPS, EPS)
    assert row[ALL_OPS.index("nans")].item() == (2 if numel > 10 else 1)
    assert row[ALL_OPS.index("infs")].item() == 2
    assert_row(row, t)


def test_counts_stay_exact_when_the_sum_overflows_without_any_inf():
    # no min/max asked for: the sum is the NaN/Inf witness, and here it overflows float32
    t = torch.full((10,), 3e38, dtype=torch.float32)
    row = tensor_stats(t, ["mean", "nans", "infs"], EPS)
    assert row[1:].tolist() == [0.0, 0.0]


def test_nan_and_inf_alone_are_counted_without_other_ops():
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf, 2.0])
    assert tensor_stats(t, ["nans"], EPS).tolist() == [1.0]
    assert tensor_stats(t, ["infs", "nans"], EPS).tolist() == [2.0, 1.0]


def test_counts_beyond_float32_precision_are_exact():
    numel = (1 << 24) + 3  # a float32 count would round this to 2**24 + 4
    t = torch.zeros(numel, dtype=torch.float32)
    t[7] = math.nan
    row = tensor_stats(t, ["zeros", "nans"], EPS)
    assert row[0].item() == (numel - 1) / numel
    assert row[1].item() == 1.0


def test_integer_and_bool_tensors_are_exact():
    ints = torch.tensor([3, -4, 0, 2**40], dtype=torch.int64)
    assert_row(tensor_stats(ints, ALL_OPS, EPS), ints)
    small = torch.tensor([1, 0, 0, 5], dtype=torch.uint8)
    assert_row(tensor_stats(small, ALL_OPS, EPS), small)
    flags = torch.tensor([True, False, True])
    assert_row(tensor_stats(flags, ALL_OPS, EPS), flags)


def test_empty_tensors_give_nan_rows_and_keep_the_others_in_place():
    a, b = sample(torch.float32, 50, seed=4), sample(torch.float32, 70, seed=5)
    rows = batch_stats([a, torch.zeros(0), b], ALL_OPS, EPS)
    assert rows.shape == (3, len(ALL_OPS))
    assert torch.isnan(rows[1]).all()
    assert_row(rows[0], a)
    assert_row(rows[2], b)
    assert torch.isnan(tensor_stats(torch.zeros(0, 3), ALL_OPS, EPS)).all()


def test_columns_follow_the_order_of_the_ops_asked_for():
    t = sample(torch.float32, 300, seed=6)
    for ops in (["max", "norm"], ["zeros", "min", "nans"], ["mean"], list(reversed(ALL_OPS))):
        assert_row(tensor_stats(t, ops, EPS), t, ops)


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown op 'median'"):
        tensor_stats(torch.ones(3), ["median"], EPS)


def test_batch_and_single_statistics_agree_for_mixed_dtypes_and_sizes():
    ts = [
        sample(torch.float32, 1000, 1),
        sample(torch.bfloat16, 257, 2),
        sample(torch.float32, CHUNK + 9, 3),
        sample(torch.float64, 33, 4),
        torch.tensor([1, 2, 3], dtype=torch.int32),
    ]
    ts[0][4] = math.nan
    batch = batch_stats(ts, ALL_OPS, EPS)
    for i, t in enumerate(ts):
        for row in (batch[i], tensor_stats(t, ALL_OPS, EPS)):
            assert_row(row, t)


def test_statistics_neither_modify_inputs_nor_record_autograd():
    w = torch.randn(64, 32, requires_grad=True)
    before = w.detach().clone()
    row = tensor_stats(w, ALL_OPS, EPS)
    rows = batch_stats([w, w * 2], ALL_OPS, EPS)
    assert torch.equal(w.detach(), before)
    assert row.grad_fn is None and rows.grad_fn is None and not row.requires_grad


def test_scratch_reuse_across_shapes_and_dtypes_keeps_results_right():
    shapes = [(10,), (4, 5), (10,), (CHUNK,), (3, 3, 3)]
    for dtype in (torch.float32, torch.bfloat16):
        for seed, shape in enumerate(shapes):
            t = sample(dtype, math.prod(shape), seed).view(shape)
            assert_row(tensor_stats(t, ALL_OPS, EPS), t)


def split_and_combine(t: torch.Tensor, sizes: list[int], ops=ALL_OPS) -> torch.Tensor:
    pieces = list(torch.split(t, sizes))
    rows = batch_stats(pieces, ops, EPS)
    counts = torch.tensor([p.numel() for p in pieces])
    return combine_rows(rows, counts, ops)


def test_combine_rows_equals_statistics_of_the_whole():
    t = sample(torch.float32, 10_000, seed=8)
    t[17] = math.nan
    t[9000] = -math.inf
    combined = split_and_combine(t, [3, 4000, 0, 5997])
    direct = tensor_stats(t, ALL_OPS, EPS)
    for op, got, want in zip(ALL_OPS, combined.tolist(), direct.tolist()):
        if op in ("min", "max", "zeros", "nans", "infs"):
            assert got == want or (math.isnan(got) and math.isnan(want)), op
        else:
            assert got == pytest.approx(want, rel=1e-6) or (math.isnan(got) and math.isnan(want)), op


def test_combined_zero_fraction_is_exact_for_awkward_piece_sizes():
    t = torch.zeros(3 * 7 * 11)
    t[::5] = 1.0
    combined = split_and_combine(t, [7, 11, 3, 210], ["zeros"])
    assert combined.item() == float((t.abs() < EPS).sum()) / t.numel()


def test_combining_only_empty_pieces_gives_a_nan_row():
    rows = batch_stats([torch.zeros(0), torch.zeros(0)], ALL_OPS, EPS)
    combined = combine_rows(rows, torch.tensor([0, 0]), ALL_OPS)
    assert torch.isnan(combined).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_small_tensors_reduced_together_equal_the_reference(dtype):
    ts = [sample(dtype, n, seed=n) for n in (1, 5, 256, 4096, 17, 300)]
    ts[2][7] = math.nan
    ts[3][0] = -math.inf
    ts.append(sample(dtype, 50_000, seed=9))  # a larger one in the same batch stays in place
    rows = batch_stats(ts, ALL_OPS, EPS)
    for row, t in zip(rows, ts):
        assert_row(row, t)


def test_cpu_statistics_leave_torchs_thread_count_as_it_was():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch_stats([sample(torch.float32, 70_000, seed=13), sample(torch.float32, 10, seed=14)], ALL_OPS, EPS)
        tensor_stats(sample(torch.float32, 70_000, seed=15), ALL_OPS, EPS)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_thread_settings_are_read_from_the_environment_when_configured(monkeypatch):
    from msmon.stats import threads as stats

    monkeypatch.setattr(stats, "_threads", None)  # restored after the test
    monkeypatch.setenv("MSMON_STAT_THREADS", "2")
    monkeypatch.setenv("MSMON_NATIVE_THREADS", "")
    assert stats.configure_threads() == stats.Threads(stats=2, native=0)
    monkeypatch.delenv("MSMON_STAT_THREADS")
    monkeypatch.setenv("MSMON_NATIVE_THREADS", "3")
    assert stats.configure_threads() == stats.Threads(stats=1, native=3)
    assert batch_stats([torch.ones(3)], ["norm"], 1e-8)[0, 0].item() == pytest.approx(math.sqrt(3), rel=1e-6)


def test_the_op_table_names_a_field_and_a_combine_rule_or_the_ops_it_is_derived_from_for_every_op():
    from msmon.config import ops as config_ops
    from msmon.stats import ops

    assert config_ops.OPS is ops.OPS and ops.OPS == [op.name for op in ops.TABLE]
    for op in ops.TABLE:
        assert op.column == op.name
        if op.derive is None:
            assert callable(op.combine) and (op.field in ops.FIELDS) == op.native
        else:  # combined through its bases, which the kernel computes where it computes them
            assert (
                op.combine is None and op.derived_from and all(ops.BY_NAME[b].derive is None for b in op.derived_from)
            )
    assert set(ops.PER_ELEMENT_OPS) >= {"mean", "zeros"}
