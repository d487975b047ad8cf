"""One DDP job that a plain script runs without trouble, under `msmon run` with
`alert.on_nan: "stop"`, where msmon used to go wrong: two ranks forked by
torch.multiprocessing (start_method="fork"), DDP's join() with uneven inputs, a GradScaler that
skips the first steps, a parameter only rank 0 uses (find_unused_parameters=True), and one step
whose loss is multiplied by 0 on rank 1 (tests/scripts/uneven_ddp_fork.py writes each rank's
truth). The same script runs plainly beside it. Every test reads the two runs' output.
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

SCRIPT = ROOT / "tests" / "scripts" / "uneven_ddp_fork.py"
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


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.pop("RANK", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the monitored job, its output directory, the truth of each rank monitored and plain)."""
    tmp = tmp_path_factory.mktemp("uneven")
    config = tmp / "monitor.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp / "out"
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config), "--output-dir", str(out)]
    argv += ["--no-torchrun", "--", sys.executable, str(SCRIPT), str(tmp), str(tmp)]
    monitored = run_job(argv, timeout=JOB_TIMEOUT, env=clean_env(), cwd=tmp)
    plain = run_job([sys.executable, str(SCRIPT), str(tmp), str(tmp), "--plain"], timeout=JOB_TIMEOUT, env=clean_env())
    assert plain.returncode == 0, plain.stderr[-3000:]
    truth = {}
    for rank in (0, 1):
        path = tmp / f"monitored_rank{rank}.pt"
        assert path.exists(), monitored.stdout[-2000:] + monitored.stderr[-5000:]
        truth[rank] = (torch.load(path), torch.load(tmp / f"plain_rank{rank}.pt"))
    return monitored, out, truth


def rank_directory(out: Path, rank: int) -> Path:
    (directory,) = glob.glob(str(out / f"*-rank{rank}-*"))
    return Path(directory)


def test_forked_ranks_are_monitored_and_their_dataloader_worker_never_is(runs):
    """Each rank built AdamW in a process forked from a parent that only imported torch; each
    iterated a DataLoader (whose worker built an optimizer) before that."""
    proc, out, _ = runs
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "nothing was monitored" not in proc.stderr and "no torch.optim optimizer" not in proc.stderr
    assert len(glob.glob(str(out / "*-rank*-*"))) == 2  # no directory of the worker, nor of the parent
    for rank, steps in STEPS.items():
        summary = json.loads((rank_directory(out, rank) / "summary.json").read_text())
        assert (summary["rank"], summary["steps_recorded"], summary["alerts"]) == (rank, steps, 0)
        assert f"msmon: rank {rank}: {steps} steps recorded, 0 alerts raised" in proc.stderr


def test_join_with_uneven_inputs_under_on_nan_stop_finishes_with_the_plain_runs_weights(runs):
    proc, _, truth = runs
    assert proc.returncode == 0 and "non-finite" not in proc.stdout + proc.stderr
    for rank, (monitored, plain) in truth.items():
        assert len(monitored["steps"]) == STEPS[rank] and monitored["skipped"] == 2
        assert monitored["weights"].keys() == plain["weights"].keys()
        assert all(torch.equal(w, plain["weights"][name]) for name, w in monitored["weights"].items()), rank


def test_steps_a_grad_scaler_skipped_leave_every_later_step_with_its_loss_and_local_gradients(runs):
    _, out, truth = runs
    for rank, (monitored, _) in truth.items():
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


def test_the_agreement_with_a_parameter_unused_on_one_rank_is_the_one_recomputed_from_gathered_gradients(runs):
    """Before rank 1 joined, the reduced gradient is recomputed from both ranks' local gradients
    gathered with torch.distributed; after, rank 0's reduced gradient is DDP's own (rank 1's
    join hook contributes zeros)."""
    _, out, truth = runs
    for rank, (monitored, _) in truth.items():
        rows = {int(r["step"]): r for r in read_csv_rows(rank_directory(out, rank), "grad_agreement")}
        assert rows.keys() == monitored["steps"].keys()
        for step, v in monitored["steps"].items():
            if math.isnan(v["cos"]):
                continue  # the zero local gradient: the next test
            cos, ratio = float(rows[step]["cos"]), float(rows[step]["norm_ratio"])
            assert (cos, ratio) == (pytest.approx(v["cos"], rel=1e-6), pytest.approx(v["norm_ratio"], rel=1e-6)), (
                rank,
                step,
            )


def test_a_rank_whose_local_gradient_is_exactly_zero_has_an_undefined_cos_and_stops_nothing(runs):
    """Rank 1's loss times 0 at step 1: every value is finite, its local gradient is zero. The
    cos is 0/0, recorded as NaN (undefined), the norm ratio 0; on_nan "stop" goes on training."""
    proc, out, truth = runs
    zero_step = next(s for s, v in truth[1][0]["steps"].items() if v["loss"] == 0.0)
    row = next(r for r in read_csv_rows(rank_directory(out, 1), "grad_agreement") if int(r["step"]) == zero_step)
    assert math.isnan(float(row["cos"])) and float(row["norm_ratio"]) == 0.0
    assert "alert.on_nan" not in proc.stdout and proc.returncode == 0
