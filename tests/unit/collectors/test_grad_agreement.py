"""grad_agreement where it cannot be recorded says so once, and its sums are those of the whole
concatenated gradient (the DDP end-to-end run is tests/e2e/test_loss_and_agreement.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows, train_steps
from msmon import TrainerMon
from msmon.collectors.grads.agreement import LocalCopies, agreement, of_pairs
from msmon.config import parse_config


def test_the_sums_are_cos_and_norm_ratio_of_the_whole_concatenated_gradient():
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    local = [torch.randn(s, generator=gen) for s in shapes]
    reduced = [0.5 * a + torch.randn(a.shape, generator=gen) for a in local]
    a = torch.cat([t.reshape(-1) for t in local]).double()
    b = torch.cat([t.reshape(-1) for t in reduced]).double()
    cos, ratio = agreement(local, reduced)
    assert cos.dtype == ratio.dtype == torch.float64
    assert float(cos) == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=1e-6)
    assert float(ratio) == pytest.approx(float(a.norm() / b.norm()), rel=1e-6)


def test_a_single_process_records_no_agreement_and_says_why_once(write_config, output_dir, caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.WARNING, logger="msmon")
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "grad_agreement": True, "format": "csv"}))
    mon.set_monitor(model, optimizer)
    train_steps(model, optimizer, 3)
    mon.close()
    said = [r.getMessage() for r in caplog.records if "grad_agreement" in r.getMessage()]
    assert said == [
        "msmon[rank 0]: grad_agreement is not recorded: a single process: its local gradient is the reduced one "
        "(said once)"
    ]
    assert read_csv_rows(rank_dir(output_dir), "grad_agreement") == []
    assert len(read_csv_rows(rank_dir(output_dir), "grad_reduced")) == 3 * 4  # wg itself goes on


def test_grad_agreement_without_wg_distribution_is_a_warning_before_training(caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.WARNING, logger="msmon")
    parse_config({"grad_agreement": True})
    assert any(
        "wg_distribution is not true; no gradient agreement is recorded" in r.getMessage() for r in caplog.records
    )


def _plain(local: list[torch.Tensor], reduced: list[torch.Tensor]) -> tuple[float, float]:
    a = torch.cat([t.reshape(-1).double() for t in local])
    b = torch.cat([t.reshape(-1).double() for t in reduced])
    return float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())


@pytest.fixture(params=["per-parameter dots (CPU)", "in-place foreach multiply (accelerators)"])
def dot_path(request):
    """Both ways LocalCopies sums: the accelerators' one on the CPU with MSMON_DEVICE_PATH=1."""
    if request.param.startswith("in-place"):
        request.getfixturevalue("device_path")


def test_the_flat_copies_dot_equals_the_plain_concatenation_leaving_out_unused_and_stale_views(dot_path):
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (16,), (4, 16), (4,), (3, 3), (7,)]
    params = {i: torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(shapes)}
    params[5] = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))  # a second flat buffer
    copies = LocalCopies(params)
    for step in range(3):  # the buffers are reused: the views left out hold an earlier step's values
        local = {i: torch.randn(p.shape, generator=gen, dtype=p.dtype) for i, p in params.items()}
        reduced = {i: 0.6 * t + torch.randn(t.shape, generator=gen, dtype=t.dtype) for i, t in local.items()}
        used = [0, 1, 3, 5] if step else list(params)  # parameters 2 and 4 had no gradient in this step
        kept = {i: copies.copy(i, local[i]) for i in used}
        assert all(torch.equal(kept[i], local[i].to(kept[i].dtype)) for i in used)
        cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in used}, copies=copies)
        want = _plain([local[i] for i in used], [reduced[i] for i in used])
        assert (float(cos), float(ratio)) == pytest.approx(want, rel=1e-6)


def test_the_agreement_takes_known_local_norms_and_reads_16_bit_reduced_gradients_in_float32(dot_path):
    gen = torch.Generator().manual_seed(2)
    shapes = [(32, 8), (32,), (5, 32)]
    params = {i: torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(shapes)}
    copies = LocalCopies(params)
    local = {i: torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    reduced = {i: (0.5 * t + torch.randn(t.shape, generator=gen)).bfloat16() for i, t in local.items()}
    kept = {i: copies.copy(i, t) for i, t in local.items()}
    norms = {0: local[0].norm(), 2: local[2].norm().double()}  # parameter 1's norm is not known: it is read
    cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in kept}, norms, copies)
    want = _plain(list(local.values()), [t.float() for t in reduced.values()])
    assert (float(cos), float(ratio)) == pytest.approx(want, rel=1e-6)


def test_a_gradient_that_fits_no_view_is_copied_into_its_own_buffer_and_still_counted(dot_path):
    params = {0: torch.nn.Parameter(torch.zeros(4, 4)), 1: torch.nn.Parameter(torch.zeros(6))}
    copies = LocalCopies(params)
    gen = torch.Generator().manual_seed(3)
    odd = torch.randn(2, 3, generator=gen)  # not the parameter's shape
    local = {0: torch.randn(4, 4, generator=gen), 1: odd}
    reduced = {i: torch.randn(t.shape, generator=gen) for i, t in local.items()}
    kept = {i: copies.copy(i, t) for i, t in local.items()}
    cos, ratio = of_pairs({i: (kept[i], reduced[i]) for i in kept}, copies=copies)
    assert (float(cos), float(ratio)) == pytest.approx(_plain(list(local.values()), list(reduced.values())), rel=1e-6)
