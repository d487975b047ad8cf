"""One DDP job that a plain script runs without trouble, where msmon used to go wrong, with
`alert.on_nan: "stop"`: DDP's join() with uneven inputs, a GradScaler that skips the first
steps, a parameter only rank 0 uses (find_unused_parameters=True), and one step whose loss is
multiplied by 0 on rank 1 (tests/scripts/uneven_ddp.py writes each rank's truth). It runs twice:
under real torchrun (2 gloo ranks) with the script's own TrainerMon, then plainly in the same
ranks; and under `msmon run` with the ranks forked by torch.multiprocessing (start_method="fork"),
monitored with no msmon code. Every test reads the two jobs' output.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_csv_rows, run_job

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "uneven_ddp.py"
CONFIG = {
    "wg_distribution": True,
    "grad_agreement": True,
    "loss_distribution": True,
    "format": ["csv"],
    "ops": ["norm", "min", "max"],
    "ndigits": 12,
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "on_nan": "stop"},
}
STEPS = {0: 7, 1: 5}  # the optimizer steps each rank takes: 9 and 7 iterations, the first 2 skipped
JOB_TIMEOUT = 240
JOBS = ("torchrun", "forked")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.pop("RANK", None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """job -> (its process, its output directory, each rank's truth); "plain": each rank's plain truth."""
    tmp = tmp_path_factory.mktemp("uneven")
    config = tmp / "monitor.json"
    config.write_text(json.dumps(CONFIG))
    found: dict = {}
    out = tmp / "torchrun_out"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    proc = run_job(
        [*argv, str(SCRIPT), str(tmp), "torchrun", str(config)],
        timeout=JOB_TIMEOUT,
        env=clean_env(MONITOR_OUTPUT_DIR=str(out)),
    )
    found["torchrun"] = (proc, out, "monitored")
    out = tmp / "forked_out"
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config), "--output-dir", str(out)]
    proc = run_job(
        [*argv, "--no-torchrun", "--", sys.executable, str(SCRIPT), str(tmp), "fork"],
        timeout=JOB_TIMEOUT,
        env=clean_env(),
        cwd=tmp,
    )
    found["forked"] = (proc, out, "forked")
    runs = {}
    for job, (proc, out, name) in found.items():
        paths = [tmp / f"{name}_rank{rank}.pt" for rank in (0, 1)]
        assert all(p.exists() for p in paths), (job, proc.stdout[-2000:] + proc.stderr[-5000:])
        runs[job] = (proc, out, {rank: torch.load(path) for rank, path in enumerate(paths)})
    runs["plain"] = {rank: torch.load(tmp / f"plain_rank{rank}.pt") for rank in (0, 1)}
    return runs


def rank_directory(out: Path, rank: int) -> Path:
    (directory,) = glob.glob(str(out / f"*-rank{rank}-*"))
    return Path(directory)


def test_forked_ranks_are_monitored_and_their_dataloader_worker_never_is(runs):
    """Each rank built AdamW in a process forked from a parent that only imported torch; each
    iterated a DataLoader (whose worker built an optimizer) before that. Each rank's summary.json
    is written although multiprocessing ends a forked child with os._exit."""
    proc, out, _ = runs["forked"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "nothing was monitored" not in proc.stderr and "no torch.optim optimizer" not in proc.stderr
    assert len(glob.glob(str(out / "*-rank*-*"))) == 2  # no directory of the worker, nor of the parent
    for rank, steps in STEPS.items():
        summary = json.loads((rank_directory(out, rank) / "summary.json").read_text())
        assert (summary["rank"], summary["steps_recorded"], summary["alerts"]) == (rank, steps, 0)
        assert f"msmon: rank {rank}: {steps} steps recorded, 0 alerts raised" in proc.stderr


@pytest.mark.parametrize("job", JOBS)
def test_join_with_uneven_inputs_under_on_nan_stop_finishes_with_the_plain_runs_weights(runs, job):
    proc, _, truth = runs[job]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "non-finite" not in proc.stdout + proc.stderr
    for rank, monitored in truth.items():
        plain = runs["plain"][rank]
        assert len(monitored["steps"]) == STEPS[rank] and monitored["skipped"] == 2
        assert monitored["weights"].keys() == plain["weights"].keys()
        assert all(torch.equal(w, plain["weights"][name]) for name, w in monitored["weights"].items()), rank


@pytest.mark.parametrize("job", JOBS)
def test_steps_a_grad_scaler_skipped_leave_every_later_step_with_its_loss_and_local_gradients(runs, job):
    _, out, truth = runs[job]
    for rank, monitored in truth.items():
        directory = rank_directory(out, rank)
        losses = {(int(r["step"]), int(r["micro_step"])): float(r["value"]) for r in read_csv_rows(directory, "loss")}
        steps = monitored["steps"]
        assert losses == {(s, 0): pytest.approx(v["loss"], rel=1e-6, abs=1e-12) for s, v in steps.items()}
        rows = read_csv_rows(directory, "grad_unreduced")
        got = {(int(r["step"]), r["name"]): float(r["norm"]) for r in rows}
        # the rank-local gradient backward left, in the scale backward ran with; rank 1 never used `extra`
        expected = {
            (s, name): norm * v["scale"]
            for s, v in steps.items()
            for name, norm in v["local_norms"].items()
            if rank == 0 or not name.startswith("extra.")
        }
        assert got == {key: pytest.approx(value, rel=1e-5, abs=1e-9) for key, value in expected.items()}


@pytest.mark.parametrize("job", JOBS)
def test_the_agreement_with_a_parameter_unused_on_one_rank_is_the_one_recomputed_from_gathered_gradients(runs, job):
    """Before rank 1 joined, the reduced gradient is recomputed from both ranks' local gradients
    gathered with torch.distributed; after, rank 0's reduced gradient is DDP's own (rank 1's
    join hook contributes zeros)."""
    _, out, truth = runs[job]
    for rank, monitored in truth.items():
        rows = {int(r["step"]): r for r in read_csv_rows(rank_directory(out, rank), "grad_agreement")}
        assert rows.keys() == monitored["steps"].keys()
        for step, v in monitored["steps"].items():
            if math.isnan(v["cos"]):
                continue  # the zero local gradient: the next test
            got = (float(rows[step]["cos"]), float(rows[step]["norm_ratio"]))
            assert got == (pytest.approx(v["cos"], rel=1e-6), pytest.approx(v["norm_ratio"], rel=1e-6)), (rank, step)


@pytest.mark.parametrize("job", JOBS)
def test_a_rank_whose_local_gradient_is_exactly_zero_has_an_undefined_cos_and_stops_nothing(runs, job):
    """Rank 1's loss times 0 at one step: every value is finite, its local gradient is zero. The
    cos is 0/0, recorded as NaN (undefined), the norm ratio 0; on_nan "stop" goes on training."""
    proc, out, truth = runs[job]
    zero_step = next(s for s, v in truth[1]["steps"].items() if v["loss"] == 0.0)
    row = next(r for r in read_csv_rows(rank_directory(out, 1), "grad_agreement") if int(r["step"]) == zero_step)
    assert math.isnan(float(row["cos"])) and float(row["norm_ratio"]) == 0.0
    assert "alert.on_nan" not in proc.stdout and proc.returncode == 0
