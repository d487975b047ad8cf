"""Sparse gradients (`nn.Embedding(sparse=True)` trained by SparseAdam next to a dense Adam) are
recorded as the dense tensors they stand for, and nothing else of the optimizer is switched off."""

from __future__ import annotations

import logging

import torch

from conftest import assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon

OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]


class Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids)).square().mean()


def test_sparse_embedding_gradients_are_recorded_as_their_dense_tensor_and_leave_the_optimizer_monitored(
    write_config, output_dir, caplog
):
    """Token 3 appears twice in a batch: the sparse gradient holds it twice, uncoalesced."""
    torch.manual_seed(0)
    model = Tagger()
    sparse_opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1)
    dense_opt = torch.optim.Adam(model.fc.parameters(), lr=0.1)
    config = {
        "wg_distribution": True,
        "mv_distribution": True,
        "mg_direction": True,
        "format": "csv",
        "ops": OPS,
    }
    mon = TrainerMon(write_config(config), params_have_main_grad=False)
    mon.set_monitor(model, sparse_opt)
    truth = []
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for _ in range(3):
            model(torch.randint(0, 12, (2, 5), generator=gen).index_fill_(1, torch.tensor([0, 1]), 3)).backward()
            grad = model.emb.weight.grad.to_dense()  # what plain torch says the gradient is
            sparse_opt.step()
            dense_opt.step()
            state = sparse_opt.state[model.emb.weight]
            truth.append({"grad": grad, "exp_avg": state["exp_avg"].clone(), "exp_avg_sq": state["exp_avg_sq"].clone()})
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
        mon.close()
    directory = rank_dir(output_dir)
    for category, key in (("grad_unreduced", "grad"), ("grad_reduced", "grad"), ("exp_avg", "exp_avg")):
        rows = read_csv_rows(directory, category)
        assert [(r["step"], r["name"]) for r in rows] == [(str(s), "emb.weight") for s in range(3)], category
        for row in rows:
            assert_row_matches(row, reference_stats(truth[int(row["step"])][key], OPS))
    for row in read_csv_rows(directory, "exp_avg_sq"):
        assert_row_matches(row, reference_stats(truth[int(row["step"])]["exp_avg_sq"], OPS))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "switched off" in m or "failed" in m]
    assert sum("is sparse; mg_direction leaves such parameters out" in m for m in messages) == 1


def test_one_optimizer_over_sparse_and_dense_gradients_records_every_parameter(write_config, output_dir):
    """SGD takes sparse gradients too: the embedding's sparse one and the linear layer's dense
    ones are read in one batch at the end of backward."""
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": OPS}), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    truth = []
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        model(torch.randint(0, 12, (3, 4), generator=gen)).backward()
        truth.append({n: p.grad.to_dense() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_reduced")
    assert sorted((r["step"], r["name"]) for r in rows) == [
        (s, n) for s in "01" for n in ("emb.weight", "fc.bias", "fc.weight")
    ]
    for row in rows:
        assert_row_matches(row, reference_stats(truth[int(row["step"])][row["name"]], OPS))
