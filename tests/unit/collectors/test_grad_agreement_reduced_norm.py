"""grad_agreement's reduced norm, taken from the step's grad_reduced rows where they were read
from the very tensors the reduction left (no pass of its own), and read from those tensors where
no row holds it: either way the cos and norm ratio are those of the plain concatenations. The
DDP end-to-end runs are tests/e2e/test_loss_and_agreement.py."""

from __future__ import annotations

import logging

import pytest
import torch

from msmon.collectors import grad_agreement
from msmon.collectors.grad_agreement import LocalCopies, ReducedNorm, partial_of_pairs
from msmon.collectors.reduced_rows import ReducedRows
from msmon.stats.sparse import any_layout_stats

OPS = ["norm", "min", "max", "mean", "zeros", "nans"]  # msprobe's six, the benchmark's
SHAPES = [(32, 8), (32,), (5, 32), (7,)]


def _plain(local: list[torch.Tensor], reduced: list[torch.Tensor]) -> tuple[float, float]:
    a = torch.cat([t.reshape(-1).double() for t in local])
    b = torch.cat([t.reshape(-1).double() for t in reduced])
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


@pytest.fixture(params=["host path", "accelerator path"])
def stats_path(request):
    """The rows as either stats path computes them (MSMON_DEVICE_PATH=1 for the accelerator's)."""
    if request.param == "accelerator path":
        request.getfixturevalue("device_path")


@pytest.fixture(params=["per-parameter dots (CPU)", "in-place foreach multiply (accelerators)"])
def dot_path(request, monkeypatch):
    monkeypatch.setattr(grad_agreement, "IN_PLACE_ON_CPU", request.param.startswith("in-place"))


def _step(seed: int):
    """A step's tensors: local gradients kept in LocalCopies, reduced ones beside them, and the
    local norms grad_unreduced's rows hold."""
    gen = torch.Generator().manual_seed(seed)
    params = {i: torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(SHAPES)}
    copies = LocalCopies(params)
    local = {i: torch.randn(s, generator=gen) for i, s in enumerate(SHAPES)}
    reduced = {i: 0.4 * t + torch.randn(t.shape, generator=gen) for i, t in local.items()}
    kept = {i: copies.copy(i, t) for i, t in local.items()}
    rows = any_layout_stats(list(local.values()), OPS, 0.0)
    local_norms = {i: rows[j][0] for j, i in enumerate(local)}
    return copies, local, reduced, kept, local_norms


def _rows(grads: dict[int, torch.Tensor], ops: list[str] = OPS) -> ReducedRows:
    """The step's grad_reduced rows of `grads`, as the stats engine computes them."""
    return ReducedRows([], list(grads), list(grads.values()), any_layout_stats(list(grads.values()), ops, 0.0))


def _no_reads(monkeypatch):
    def read(_tensors):
        raise AssertionError("the reduced gradients were read again")

    monkeypatch.setattr(grad_agreement, "_square_sum", read)


def test_the_reduced_norm_from_the_grad_reduced_rows_gives_the_plain_cos_and_ratio_without_a_pass(
    stats_path, dot_path, monkeypatch
):
    copies, local, reduced, kept, local_norms = _step(0)
    partial = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=True)
    assert partial is not None and partial.reduced_square is None
    rows = _rows(reduced)
    _no_reads(monkeypatch)  # the local norms are the rows' too: nothing reads a gradient's norm again
    cos, ratio = partial.finish(rows.described(), rows.column(OPS))
    assert cos.dtype == ratio.dtype == torch.float64
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)


def test_the_rows_of_part_of_the_gradients_are_taken_and_the_rest_read(stats_path, dot_path):
    copies, local, reduced, kept, local_norms = _step(1)
    partial = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=True)
    rows = _rows({i: reduced[i] for i in (3, 1)})  # rows of two, in another order; 0 and 2 have none
    cos, ratio = partial.finish(rows.described(), rows.column(OPS))
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)


@pytest.mark.parametrize("case", ["no norm op", "no row", "rows of other tensors"])
def test_where_no_row_holds_the_reduced_norm_it_is_read_from_the_gradients_the_reduction_left(stats_path, case):
    copies, local, reduced, kept, local_norms = _step(2)
    partial = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=True)
    if case == "no norm op":
        rows = _rows(reduced, ["min", "max"])
        described, norms = rows.described(), rows.column(["min", "max"])
        assert norms is None
    elif case == "no row":
        described, norms = {}, None
    else:  # rows read from other tensors: scaled copies, as a script's new `.grad` would be
        rows = _rows({i: 2.0 * t for i, t in reduced.items()})
        described, norms = rows.described(), rows.column(OPS)
    cos, ratio = partial.finish(described, norms)
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)


def test_a_reduced_gradient_rewritten_in_place_before_the_rows_gives_no_agreement_rather_than_a_wrong_one():
    copies, _local, reduced, kept, local_norms = _step(3)
    partial = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=True)
    reduced[2].mul_(0.5)  # clipped in place between the end of backward and the optimizer step
    assert not partial.unchanged()
    rows = _rows(reduced)  # the rows describe the clipped tensors: not the norm the cosine needs
    assert partial.finish(rows.described(), rows.column(OPS)) is None


def test_the_norm_read_at_the_reduction_is_not_touched_by_a_later_rewrite():
    copies, local, reduced, kept, local_norms = _step(4)
    want = _plain(list(local.values()), list(reduced.values()))
    partial = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies)
    assert partial is not None and partial.reduced_square is not None
    for t in reduced.values():
        t.mul_(0.5)  # a GradScaler's unscale_ or a clip, after the reduction
    rows = _rows(reduced)
    cos, ratio = partial.finish(rows.described(), rows.column(OPS))
    assert (float(cos), float(ratio)) == pytest.approx(want, rel=1e-6)


def test_the_norm_waits_for_the_rows_only_after_a_step_showed_nothing_rewrites_the_reduced_gradients(caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.WARNING, logger="msmon")
    choice = ReducedNorm()
    assert not choice.later(OPS)  # the first step reads it at the reduction, and checks
    copies, local, reduced, kept, local_norms = _step(5)
    first = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=False)
    rows = _rows(reduced)
    assert choice.finish(first, rows.described(), rows.column(OPS), (0, 0)) is not None
    assert choice.later(OPS) and not choice.later(["min", "max"])  # without the norm op: read at the reduction

    for step in (1, 2):  # a later step whose gradients are rewritten in place once: that step has no row
        copies, local, reduced, kept, local_norms = _step(5 + step)
        later = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies, norm_later=True)
        if step == 2:
            reduced[0].mul_(0.25)
        rows = _rows(reduced)
        got = choice.finish(later, rows.described(), rows.column(OPS), (0, step))
        if step == 1:
            assert got is not None
            assert (float(got[0]), float(got[1])) == pytest.approx(
                _plain(list(local.values()), list(reduced.values())), rel=1e-6
            )
        else:
            assert got is None
    assert not choice.later(OPS)  # read at the reduction from then on
    said = [r.getMessage() for r in caplog.records if "rewritten" in r.getMessage()]
    assert len(said) == 1 and "step 2" in said[0] and "no grad_agreement row" in said[0]


def test_gradients_rewritten_in_the_first_step_keep_the_norm_read_at_the_reduction(caplog):
    caplog.set_level(logging.WARNING, logger="msmon")
    choice = ReducedNorm()
    copies, local, reduced, kept, local_norms = _step(8)
    want = _plain(list(local.values()), list(reduced.values()))
    first = partial_of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies)
    for t in reduced.values():
        t.mul_(0.5)  # unscaled in place every step (a GradScaler)
    rows = _rows(reduced)
    got = choice.finish(first, rows.described(), rows.column(OPS), (0, 0))
    assert got is not None and (float(got[0]), float(got[1])) == pytest.approx(want, rel=1e-6)
    assert not choice.later(OPS)
    assert not [r for r in caplog.records if "rewritten" in r.getMessage()]


def test_the_dot_products_total_is_bit_for_bit_the_per_pair_float64_total_in_any_dtype_mix():
    gen = torch.Generator().manual_seed(9)
    pairs = []
    for shape, dtype, reduced_dtype in [
        ((64, 8), torch.float32, torch.float32),
        ((33,), torch.float32, torch.bfloat16),  # a 16-bit reduced gradient: read in float32
        ((5, 7), torch.float64, torch.float64),
        ((1,), torch.float32, torch.float32),
    ]:
        a = torch.randn(shape, generator=gen, dtype=dtype)
        pairs.append((a, torch.randn(shape, generator=gen, dtype=dtype).to(reduced_dtype)))
    per_pair = torch.stack([grad_agreement._dot(a, b) for a, b in pairs]).sum()  # each widened, then totalled
    assert torch.equal(grad_agreement._dots(pairs), per_pair)
    plain = sum(float(a.double().reshape(-1) @ b.double().reshape(-1)) for a, b in pairs)
    assert float(grad_agreement._dots(pairs)) == pytest.approx(plain, rel=1e-6)
