"""The monitor never changes or breaks training."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tiny_gpt import TinyGPT, lm_loss, synthetic_batch

import msmon.collectors.grads.collector as grads_module
from conftest import ALL_OPS, ROOT, rank_dir, read_csv_rows
from msmon import TrainerMon

EVERYTHING = {
    "wg_distribution": True,
    "monitor_mbs_grad": True,
    "loss_distribution": True,
    "grad_agreement": True,  # single process: not recorded, said once
    "param_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "mg_direction": True,
    "stack_info": True,
    "heatmap_visualize": True,
    "recording_l2_features": True,
    "l2_targets": {"linear_hook": []},
    "format": ["csv", "tensorboard", "api"],
    "ops": ALL_OPS,
    "alert": {
        "rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
        "dump": True,
    },
}


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab=100, d_model=32, n_layer=2, n_head=2, seq_len=16)
        self.drop = torch.nn.Dropout(0.2)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, idx):
        return self.relu(self.drop(self.gpt(idx)))


def train(config_path: str | None, steps: int = 20) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = DropoutNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = None
    if config_path:
        mon = TrainerMon(config_path)
        mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        for _ in range(2):
            loss = lm_loss(model, synthetic_batch(gen, batch=4, seq_len=16, vocab=100))
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    if mon is not None:
        mon.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_losses_and_parameters_are_bit_identical_with_every_metric_on(write_config, output_dir):
    plain_losses, plain_params = train(None)
    monitored_losses, monitored_params = train(write_config(EVERYTHING))
    assert monitored_losses == plain_losses
    for name, value in plain_params.items():
        assert torch.equal(value, monitored_params[name]), name
    # and the monitor really did record something for every category
    out = rank_dir(output_dir)
    for category in (
        "actv",
        "actv_grad",
        "grad_unreduced",
        "grad_reduced",
        "param_origin",
        "exp_avg",
        "update",
        "linear_hook",
        "loss",
    ):
        assert read_csv_rows(out, category), category


def test_failure_inside_a_collector_is_contained_and_logged_once(write_config, output_dir, monkeypatch, caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.ERROR, logger="msmon")

    def broken_hook(self, index):
        def hook(param):
            raise RuntimeError("injected statistics failure")

        return hook

    monkeypatch.setattr(grads_module.GradCollector, "_make_hook", broken_hook)
    plain_losses, _ = train(None, steps=4)
    monitored_losses, _ = train(
        write_config({"wg_distribution": True, "param_distribution": True, "format": "csv", "ops": ["norm"]}), steps=4
    )
    assert monitored_losses == plain_losses
    failures = [r.getMessage() for r in caplog.records if "injected statistics failure" in r.getMessage()]
    assert len(failures) == 1
    assert "msmon[rank 0]: weight gradients monitoring failed at step 0" in failures[0]
    out = rank_dir(output_dir)
    assert read_csv_rows(out, "grad_unreduced") == []
    assert {int(r["step"]) for r in read_csv_rows(out, "param_origin")} == {0, 1, 2, 3}


@pytest.mark.e2e
def test_rows_of_finished_steps_survive_sigterm(tmp_path, write_config):
    config = write_config({"wg_distribution": True, "format": "csv", "ops": ["norm"]})
    out = tmp_path / "out"
    ready = tmp_path / "ready"
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from conftest import MLP
        from msmon import TrainerMon
        model = MLP(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon({config!r}); mon.set_monitor(model, opt, grad_acc_steps=1)
        for step in range(1000):
            model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
            if step == 5:
                open({str(ready)!r}, "w").close()
            time.sleep(0.05)
    """)
    )
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out))
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    steps = sorted({int(r["step"]) for r in read_csv_rows(rank_dir(out), "grad_reduced")})
    assert steps[:6] == [0, 1, 2, 3, 4, 5]
    assert steps == list(range(len(steps)))
