"""msmon's own threads never start an OpenMP team of their own (which slows the training's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from msmon.system.torch_threads import torch_on_this_thread_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_on_this_thread_only_changes_the_calling_thread_and_no_other():
    before = torch.get_num_threads()
    seen = {}

    def helper():
        seen["found"] = torch_on_this_thread_only()
        seen["threads"] = torch.get_num_threads()
        torch.log10(torch.rand(300_000, dtype=torch.float64)).sum()  # large and MKL: would go parallel
        seen["after"] = torch.get_num_threads()

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen["found"], "torch's OpenMP runtime was not found"
    assert seen["threads"] == seen["after"] == 1
    assert torch.get_num_threads() == before


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
    from tiny_gpt import TinyGPT, lm_loss, synthetic_batch
    from msmon import TrainerMon

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = TinyGPT(n_layer=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step():
        lm_loss(model, synthetic_batch(gen, 4, 64)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the training's own OpenMP team exists from here on
    plain = os_threads()
    monitor = TrainerMon(sys.argv[2])
    monitor.set_monitor(model, optimizer, grad_acc_steps=1)
    for _ in range(4):
        step()
    monitor.writer.drain()  # every step written: the writer has run its torch ops
    monitored = os_threads()
    monitor.close()
    print(json.dumps({"plain": plain, "monitored": monitored}))
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads through /proc")
def test_the_writer_thread_starts_no_thread_team_of_its_own(tmp_path, write_config):
    config = write_config(
        {
            "format": ["csv", "tensorboard", "api"],
            "all_xy": True,
            "wg_distribution": True,
            "mv_distribution": True,
            "param_distribution": True,
            "ops": ["norm", "min", "max", "mean", "zeros", "nans", "infs"],
            "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 3.0}}], "dump": True},
        }
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ROOT, config], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["monitored"] == counts["plain"] + 1  # the writer thread, and no team of its own
