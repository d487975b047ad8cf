"""grad_agreement's sums on the CPU: the reduced norm comes out of the same per-parameter pass as
the dot product (no `_foreach_norm` of its own), and on the accelerators' path it is one
`_foreach_norm`; either way the cos and norm ratio are those of the plain concatenations (the
DDP end-to-end runs are tests/e2e/test_loss_and_agreement.py)."""

from __future__ import annotations

import pytest
import torch

from msmon.collectors.grads import agreement as grad_agreement
from msmon.collectors.grads.agreement import LocalCopies, _dots_and_squares, agreement, of_pairs

SHAPES = [(32, 8), (32,), (5, 32), (7,), (1,)]


def _plain(local: list[torch.Tensor], reduced: list[torch.Tensor]) -> tuple[float, float]:
    a = torch.cat([t.reshape(-1).double() for t in local])
    b = torch.cat([t.reshape(-1).double() for t in reduced])
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


def _step(seed: int, reduced_dtype: torch.dtype = torch.float32):
    """A step's tensors: local gradients kept in LocalCopies, reduced ones beside them, and the
    local norms grad_unreduced's rows hold."""
    gen = torch.Generator().manual_seed(seed)
    params = {i: torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(SHAPES)}
    copies = LocalCopies(params)
    local = {i: torch.randn(s, generator=gen) for i, s in enumerate(SHAPES)}
    reduced = {i: (0.4 * t + torch.randn(t.shape, generator=gen)).to(reduced_dtype) for i, t in local.items()}
    kept = {i: copies.copy(i, t) for i, t in local.items()}
    local_norms = {i: t.norm() for i, t in local.items()}
    return copies, local, reduced, kept, local_norms


def _counting_norms(monkeypatch) -> list[int]:
    """The number of tensors each `_square_sum` (one `_foreach_norm` pass) is given."""
    calls: list[int] = []
    square_sum = grad_agreement._square_sum

    def counted(tensors):
        calls.append(len(tensors))
        return square_sum(tensors)

    monkeypatch.setattr(grad_agreement, "_square_sum", counted)
    return calls


@pytest.mark.parametrize("reduced_dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_the_reduced_norm_comes_from_the_dot_products_pass_with_the_plain_values(reduced_dtype, monkeypatch):
    copies, local, reduced, kept, local_norms = _step(0, reduced_dtype)
    calls = _counting_norms(monkeypatch)
    cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies)
    assert calls == []  # no pass of its own over the reduced gradients (nor the local ones: their rows')
    assert cos.dtype == ratio.dtype == torch.float64
    want = _plain(list(local.values()), [t.float() for t in reduced.values()])
    assert (float(cos), float(ratio)) == pytest.approx(want, rel=1e-6)


def test_on_the_accelerators_path_the_reduced_norm_is_one_foreach_norm_with_the_same_values(monkeypatch, device_path):
    """MSMON_DEVICE_PATH=1 takes the accelerators' in-place multiply (before, only a module flag did)."""
    copies, local, reduced, kept, local_norms = _step(1)
    calls = _counting_norms(monkeypatch)
    cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in kept}, local_norms, copies)
    assert calls == [len(SHAPES)]  # the reduced gradients, once, in one multi-tensor norm
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)


def test_a_local_tensor_outside_the_flat_buffers_gets_both_products_on_the_accelerators_path_too(device_path):
    copies, local, reduced, kept, local_norms = _step(2)
    odd = torch.randn(2, 3, generator=torch.Generator().manual_seed(7))  # fits no view: its own buffer
    local[9], reduced[9] = odd, 0.5 * odd + 1.0
    kept[9] = copies.copy(9, odd)
    cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in kept}, None, copies)
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)


def test_the_products_totals_are_the_plain_float64_ones_in_any_dtype_mix():
    gen = torch.Generator().manual_seed(9)
    pairs = []
    for shape, dtype, reduced_dtype in [
        ((64, 8), torch.float32, torch.float32),
        ((33,), torch.float32, torch.bfloat16),  # a 16-bit reduced gradient: read in float32
        ((5, 7), torch.float64, torch.float64),  # float64 copies stay float64
        ((1,), torch.bfloat16, torch.bfloat16),  # 16-bit local tensors (agreement() without copies)
    ]:
        a = torch.randn(shape, generator=gen).to(dtype)
        pairs.append((a, torch.randn(shape, generator=gen).to(reduced_dtype)))
    dot, square = _dots_and_squares(pairs)
    assert dot.dtype == square.dtype == torch.float64
    assert float(dot) == pytest.approx(sum(float(a.double().reshape(-1) @ b.double().reshape(-1)) for a, b in pairs))
    assert float(square) == pytest.approx(sum(float(b.double().square().sum()) for _, b in pairs), rel=1e-6)
    cos, ratio = agreement([a for a, _ in pairs], [b for _, b in pairs])
    assert (float(cos), float(ratio)) == pytest.approx(_plain([a for a, _ in pairs], [b for _, b in pairs]), rel=1e-6)
