"""summary.json's "job": what `msmon diff` prints as the contract of a run, read at attach."""

from __future__ import annotations

import json

import torch

from conftest import MLP, rank_dir
from msmon import TrainerMon


def test_the_summary_says_world_size_dtypes_micro_batches_device_and_versions(output_dir, write_config):
    model = MLP().to(torch.float64)
    model.fc2.to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv"}))
    mon.set_monitor(model, optimizer)
    for _ in range(2):
        for _ in range(3):  # three micro-batches a step: counted in the first step
            x = torch.randn(4, 8, dtype=torch.float64)
            model.fc2(model.act(model.fc1(x)).to(torch.bfloat16)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    job = json.loads((rank_dir(output_dir) / "summary.json").read_text())["job"]
    assert job["world_size"] == 1 and job["pp_stage"] == 0
    assert job["param_dtypes"] == {"bfloat16": 2, "float64": 2}
    assert job["grad_acc_steps"] == 3
    assert job["device"]["type"] == "cpu" and job["torch"] == torch.__version__
    assert job["optimizer_family"] == "torch" and job["model"] == ["MLP"]
    assert job["parallel"] == {"from": "none"}
