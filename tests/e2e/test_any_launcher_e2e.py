"""Acceptance: `msmon run -- <any launcher>` monitors every training rank the launcher starts,
with the real launcher, 2 CPU ranks on gloo: accelerate launch, Lightning's own re-launch of
the script, the deepspeed launcher, torch.multiprocessing.spawn, and srun's tasks (started
here the way srun starts them, fake_srun.py, since the machine has no SLURM).

Each rank must have exactly one directory named for its own rank, with every step recorded.
The values are checked independently: the weights at step 0 against the same seeded model
built here, and the reduced gradients of both ranks against each other (DDP all-reduces them,
so the two monitored ranks must agree). The launcher's own processes (accelerate's, deepspeed's,
the mp.spawn parent) must say nothing, in particular not "no torch.optim optimizer was created".
Every job runs through conftest.run_job: past JOB_TIMEOUT it is killed with all its processes
and its test fails with what it printed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import MLP, ROOT, read_csv_rows, run_job

pytestmark = pytest.mark.e2e

SCRIPTS = ROOT / "tests" / "scripts"
BIN = Path(sys.executable).parent  # accelerate's and deepspeed's programs, installed beside python
MSMON = [sys.executable, "-m", "msmon.launcher"]
CONFIG = {"wg_distribution": True, "param_distribution": True, "format": ["csv"], "ops": ["norm", "max"], "ndigits": 12}
STEPS = 3
# each job takes under a minute; a job past this is killed with every process it started, and its
# test fails with what it printed (conftest.run_job), never leaving ranks waiting for each other
JOB_TIMEOUT = 300


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_", "SLURM_"))}
    env.pop("RANK", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("config") / "monitor.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def msmon_run(config: str, out: Path, *command: str, no_torchrun: bool = False, env: dict | None = None):
    flags = ["--no-torchrun"] if no_torchrun else []
    argv = [*MSMON, "run", "--config", config, "--output-dir", str(out), *flags, "--", *command]
    return run_job(argv, timeout=JOB_TIMEOUT, env=env or clean_env(), cwd=out.parent)


def seeded(model: Callable[[], torch.nn.Module], prefix: str = "") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {prefix + name: p.detach() for name, p in model().named_parameters()}


def sequential(activation: type[torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    return lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), activation(), torch.nn.Linear(16, 4))


def rows_by_name(directory: Path, category: str, step: int) -> dict[str, dict[str, str]]:
    return {r["name"]: r for r in read_csv_rows(directory, category) if int(r["step"]) == step}


def assert_every_rank_monitored(proc, out: Path, weights: dict[str, torch.Tensor], writers=(0, 1)) -> None:
    """`writers`: the ranks that write the replicated weights and reduced gradients (DeepSpeed's
    data-parallel replicas leave them to rank 0)."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "no torch.optim optimizer was created" not in proc.stderr, proc.stderr[-3000:]
    assert "nothing was monitored" not in proc.stderr and "no training process loaded msmon" not in proc.stderr
    directories = {}
    for rank in (0, 1):
        (directory,) = glob.glob(str(out / f"*-rank{rank}-*"))  # one per rank: no launcher process wrote one
        directories[rank] = Path(directory)
        summary = json.loads((directories[rank] / "summary.json").read_text())
        assert summary["rank"] == rank and summary["steps_recorded"] == STEPS, summary
        assert re.search(rf"^msmon: rank {rank}: {STEPS} steps recorded, 0 alerts raised", proc.stderr, re.M)
    assert len(glob.glob(str(out / "*-rank*-*"))) == 2
    for rank in writers:
        origin = rows_by_name(directories[rank], "param_origin", 0)
        assert set(origin) == set(weights), (rank, sorted(origin))
        for name, weight in weights.items():  # the seeded model, rebuilt here
            assert float(origin[name]["norm"]) == pytest.approx(weight.double().norm().item(), rel=1e-6), name
            assert float(origin[name]["max"]) == pytest.approx(weight.double().max().item(), rel=1e-6), name
    for step in range(STEPS):  # all-reduced: the ranks saw the same gradients, and real ones
        reduced = [rows_by_name(directories[rank], "grad_reduced", step) for rank in writers]
        assert all(set(rows) == set(weights) for rows in reduced), step
        for name in weights:
            norms = [float(rows[name]["norm"]) for rows in reduced]
            assert norms[0] > 0 and norms == pytest.approx([norms[0]] * len(norms), rel=1e-6), (step, name, norms)
    for rank in (0, 1):  # and every rank its own local gradients
        assert rows_by_name(directories[rank], "grad_unreduced", STEPS - 1).keys() == weights.keys()


def test_accelerate_launch_monitors_both_ranks_and_its_own_process_stays_silent(config, tmp_path):
    """accelerate runs CPU ranks through its multi-process launcher (torch elastic inside the
    `accelerate` process); `--cpu` would start one process. Given without --no-torchrun too:
    a program after `--` runs as it is."""
    out = tmp_path / "out"
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    proc = msmon_run(config, out, *command, str(SCRIPTS / "launcher_accelerate.py"))
    assert_every_rank_monitored(proc, out, seeded(sequential(torch.nn.Tanh)))


def test_lightning_relaunching_its_own_script_monitors_both_ranks(config, tmp_path):
    """`python train.py` with Trainer(devices=2, strategy="ddp"): rank 0 is the script's own
    process, which re-runs the script for rank 1 before it builds its optimizer."""
    out = tmp_path / "out"
    env = clean_env(MASTER_PORT=str(free_port()))
    proc = msmon_run(config, out, str(SCRIPTS / "launcher_lightning.py"), no_torchrun=True, env=env)
    assert_every_rank_monitored(proc, out, seeded(sequential(torch.nn.ReLU), prefix="net."))


def test_the_deepspeed_launcher_monitors_both_ranks(config, tmp_path):
    """`deepspeed --num_accelerators 2` on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu):
    the `deepspeed` runner starts deepspeed.launcher.launch, which starts the two ranks."""
    out = tmp_path / "out"
    env = clean_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", PYTHONUNBUFFERED="1")
    command = ["deepspeed", "--num_accelerators", "2", "--master_port", str(free_port())]
    proc = msmon_run(config, out, *command, str(SCRIPTS / "launcher_deepspeed.py"), env=env)
    assert "attached at deepspeed.initialize" in proc.stderr, proc.stderr[-3000:]
    assert_every_rank_monitored(proc, out, seeded(MLP), writers=(0,))


def test_torch_multiprocessing_spawn_monitors_both_spawned_ranks(config, tmp_path):
    out = tmp_path / "out"
    script = [str(SCRIPTS / "launcher_spawn.py"), "--how", "spawn", "--rendezvous", str(tmp_path)]
    proc = msmon_run(config, out, *script, no_torchrun=True)
    assert_every_rank_monitored(proc, out, seeded(MLP))


def test_srun_tasks_are_monitored_with_their_slurm_rank_before_torch_distributed_starts(config, tmp_path):
    """srun runs the whole command line once per task: `srun msmon run --no-torchrun -- train.py`.
    The script builds its optimizer before init_process_group, so the rank msmon names the
    directory after can only come from SLURM_PROCID."""
    out = tmp_path / "out"
    script = [str(SCRIPTS / "launcher_spawn.py"), "--how", "slurm", "--rendezvous", str(tmp_path)]
    task = [*MSMON, "run", "--config", config, "--output-dir", str(out), "--no-torchrun", "--", *script]
    srun = [sys.executable, str(SCRIPTS / "fake_srun.py"), "2", "--", *task]
    proc = run_job(srun, timeout=JOB_TIMEOUT, env=clean_env(), cwd=tmp_path)
    assert_every_rank_monitored(proc, out, seeded(MLP))
