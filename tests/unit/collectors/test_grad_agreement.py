"""grad_agreement where it cannot be recorded says so once, and its sums are those of the whole
concatenated gradient (the DDP end-to-end run is tests/e2e/test_loss_and_agreement.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows, train_steps
from msmon import TrainerMon
from msmon.collectors.grad_agreement import agreement
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
