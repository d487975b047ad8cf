"""`msmon diff` on real jobs (tests/scripts/diff_train.py under `msmon run`): an MLP with a
LayerNorm, AdamW, gradient clipping, every category recorded to CSV; the DDP jobs write Parquet
files too (`format: ["csv", "parquet"]`: `msmon diff` reads their Parquet files, as `msmon db`
does, and a test compares the answers from CSV-only and Parquet-only copies of them).

Three 2-rank DDP jobs on gloo (2 micro-batches a rank and step): the same job twice, and once
with fc2's output times 1 + 1e-4 from step 2. Five single-process jobs with 4 micro-batches a
step (the DDP jobs' global batch): threads 1, 2 and 3 (LayerNorm's backward sums its weight
gradients in per-thread parts, so the stored values of these reruns differ), a fourth rerun on
4 threads, and the 1-thread job with the learning rate x 1.01. Each test reads some of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT, run_job
from msmon.launcher.cli import main
from msmon.offline.diff.inputs import open_input

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "tests" / "scripts" / "diff_train.py")
MSMON = [sys.executable, "-m", "msmon.launcher"]
STEPS, PERTURB_STEP = 4, 2
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "loss_distribution": True,
    "format": "csv",
    "ops": ["norm", "min", "max", "mean"],
}
BOTH_FORMATS = {**CONFIG, "format": ["csv", "parquet"], "parquet_roll_steps": 2}  # the DDP jobs': two files a rank
WHOLE_TENSOR = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["MSMON_NATIVE_STATS"] = "0"  # torch's reductions: no kernel built for these jobs
    return env


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    """Every job's output directory, by name."""
    base = tmp_path_factory.mktemp("diff_jobs")
    config, both = base / "monitor.json", base / "both_formats.json"
    config.write_text(json.dumps(CONFIG))
    both.write_text(json.dumps(BOTH_FORMATS))
    runs = {  # in the order they start: never two DDP jobs at once on two workers, mostly
        "ddp": (["--standalone", "--nproc-per-node", "2"], ["--grad-acc", "2"]),
        "single_1": (["--no-torchrun"], ["--grad-acc", "4", "--threads", "1"]),
        "ddp_again": (["--standalone", "--nproc-per-node", "2"], ["--grad-acc", "2"]),
        "single_2": (["--no-torchrun"], ["--grad-acc", "4", "--threads", "2"]),
        "ddp_fc2": (
            ["--standalone", "--nproc-per-node", "2"],
            ["--grad-acc", "2", "--perturb-from", str(PERTURB_STEP)],
        ),
        "single_3": (["--no-torchrun"], ["--grad-acc", "4", "--threads", "3"]),
        "single_4": (["--no-torchrun"], ["--grad-acc", "4", "--threads", "4"]),
        "single_lr": (["--no-torchrun"], ["--grad-acc", "4", "--threads", "1", "--lr-scale", "1.01"]),
    }

    def one(name: str) -> tuple[str, subprocess.CompletedProcess]:
        launch, script_args = runs[name]
        chosen = both if name.startswith("ddp") else config
        argv = [*MSMON, "run", "--config", str(chosen), "--output-dir", str(base / name), *launch, "--", SCRIPT]
        return name, run_job([*argv, "--steps", str(STEPS), *script_args], timeout=300, env=clean_env())

    # two at a time: a job spends part of its time starting (imports), and CI's two cores are its own
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, proc in pool.map(one, runs):
            assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    return {name: base / name for name in runs}


def diff(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MSMON, "diff", *map(str, args)], capture_output=True, text=True, timeout=120, env=clean_env()
    )


def answer(tmp_path: Path, *args: str | Path) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "diff.json"
    proc = diff(*args, "--json", path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def test_the_same_deterministic_ddp_job_run_twice_is_identical_and_exits_0(jobs, tmp_path):
    proc, data = answer(tmp_path, jobs["ddp"], jobs["ddp_again"], "--exact")
    assert proc.returncode == 0, proc.stdout
    tensors = data["compared"]["tensors"]
    assert f"result: identical over {STEPS} steps x {tensors} tensors" in proc.stdout
    # 6 modules' inputs and outputs, 11 of their gradients (the batch has none), 8 weights in 6 categories, the loss
    assert tensors == 72
    assert data["first_divergence"] is None and data["identical"] and data["layout"]["same"]
    assert set(data["comparison"].values()) == {"rank by rank"}
    assert "tolerance: exact" in proc.stdout and "world size 2" in proc.stdout


def test_a_factor_of_1e_4_in_fc2s_forward_from_step_2_parts_at_step_2_in_fc2s_forward_output(jobs, tmp_path):
    proc, data = answer(tmp_path, jobs["ddp"], jobs["ddp_fc2"])  # the default tolerance: it catches 1e-4
    assert proc.returncode == 1, proc.stdout
    first = data["first_divergence"]
    assert (first["step"], first["category"], first["module"], first["name"]) == (
        PERTURB_STEP,
        "actv",
        "fc2",
        "fc2.output",
    )
    assert first["micro_step"] == 0 and first["rank"] == 0
    assert first["relative_difference"] == pytest.approx(1e-4, rel=0.05)
    assert data["interpretation"].startswith("numerics in fc2's forward")
    assert f"result: parted at step {PERTURB_STEP}: forward output of fc2" in proc.stdout
    front = {row["step"]: row for row in data["front"]}
    assert all(front[step]["over"] == 0 for step in range(PERTURB_STEP))
    at_k = front[PERTURB_STEP]["categories"]
    assert at_k["param_origin"]["over"] == 0  # the weights it started from still agree
    assert at_k["actv"]["over"] > 0 and at_k["param_updated"]["over"] > 0
    assert data["tolerance"]["mode"] == "relative" and data["tolerance"]["default"] is True


def test_ddp_against_one_process_on_the_same_global_batch_agrees_on_whole_tensors_at_every_step(jobs, tmp_path):
    proc, data = answer(tmp_path, jobs["ddp"], jobs["single_1"], "--rtol", "1e-4")
    assert not data["layout"]["same"] and "ranks 0, 1 against 0" in data["layout"]["why"]
    comparison = data["comparison"]
    for category in WHOLE_TENSOR:
        assert comparison[category] == "one value per tensor"
    assert comparison["actv"].startswith("order statistics over ranks x micro-steps")
    for category in ("actv_grad", "grad_unreduced", "loss"):  # a script divides its loss by its micro-batches
        assert comparison[category].startswith("order statistics") and "not counted" in comparison[category]
    assert "compared order statistics over ranks x micro-steps" in proc.stdout
    steps = {row["step"]: row["categories"] for row in data["front"]}
    assert sorted(steps) == list(range(STEPS))
    for step, categories in steps.items():
        for category in WHOLE_TENSOR:
            assert categories[category]["compared"] > 0 and categories[category]["over"] == 0, (step, category)
        assert categories["actv"]["over"] == 0  # the same micro-batches: the same activations, ranks pooled
    assert proc.returncode == 0 and data["first_divergence"] is None
    assert any("world size: 2 against 1" in line for line in data["contract"]["differs"])


def test_calibrated_on_three_thread_counts_a_fourth_rerun_passes_and_lr_x_1_01_parts_at_step_0(jobs, tmp_path):
    reruns = [jobs["single_1"], jobs["single_2"], jobs["single_3"]]
    exact = diff(reruns[0], reruns[1], "--exact")
    assert exact.returncode == 1, "the reruns are not bit for bit the same"
    golden = tmp_path / "golden.json"
    proc = diff("--calibrate", *reruns, "-o", golden)
    assert proc.returncode == 0, proc.stderr
    observed = json.loads(golden.read_text())["observed"]
    assert max(v for ops in observed.values() for v in ops.values()) > 0
    fourth, data = answer(tmp_path, golden, jobs["single_4"])
    assert fourth.returncode == 0, fourth.stdout
    assert data["tolerance"]["mode"] == "calibrated" and "tolerance: calibrated from" in fourth.stdout
    lr, data = answer(tmp_path, golden, jobs["single_lr"])
    assert lr.returncode == 1, lr.stdout
    first = data["first_divergence"]
    assert (first["step"], first["category"]) == (0, "param_updated")
    assert data["interpretation"].startswith("the optimizer step or the learning rate")
    step_0 = data["front"][0]["categories"]
    assert all(step_0[c]["over"] == 0 for c in ("actv", "grad_reduced", "exp_avg", "exp_avg_sq"))


def in_process(tmp_path: Path, a: Path, b: Path, *args: str) -> tuple[int, dict]:
    """`msmon diff A B --json` in this process (it never imports torch): exit code and answer,
    less the inputs' paths and the count of CSV files skipped as byte for byte the same."""
    path = tmp_path / "answer.json"
    result = CliRunner().invoke(main, ["diff", str(a), str(b), "--json", str(path), *args])
    assert result.exit_code in (0, 1), result.output
    data = json.loads(path.read_text())
    del data["a"], data["b"], data["compared"]["files_identical"]
    return result.exit_code, data


def test_the_csv_and_the_parquet_files_of_the_same_ddp_jobs_give_the_same_verdict_divergence_and_counts(jobs, tmp_path):
    csv, parquet = {}, {}
    for name in ("ddp", "ddp_again", "ddp_fc2"):
        csv[name] = Path(
            shutil.copytree(jobs[name], tmp_path / f"{name}_csv", ignore=shutil.ignore_patterns("parquet"))
        )
        parquet[name] = Path(
            shutil.copytree(jobs[name], tmp_path / f"{name}_pq", ignore=shutil.ignore_patterns("*.csv"))
        )
        assert len(list(parquet[name].glob("parquet/run=*/rank_block=0/part-*.parquet"))) == 4  # 2 ranks x 2 files
    assert open_input(str(parquet["ddp"]), None).facts.storage == ["parquet"]
    assert open_input(str(jobs["ddp"]), None).facts.storage == ["parquet"]  # both formats: the values read once
    assert open_input(str(csv["ddp"]), None).facts.storage == ["csv"]
    same = in_process(tmp_path, csv["ddp"], csv["ddp_again"], "--exact")
    assert same[0] == 0 and same[1]["compared"]["tensors"] == 72
    assert in_process(tmp_path, parquet["ddp"], parquet["ddp_again"], "--exact") == same
    parted = in_process(tmp_path, csv["ddp"], csv["ddp_fc2"])
    assert parted[0] == 1 and parted[1]["first_divergence"]["name"] == "fc2.output"
    assert parted[1]["first_divergence"]["step"] == PERTURB_STEP
    assert in_process(tmp_path, parquet["ddp"], parquet["ddp_fc2"]) == parted
    assert in_process(tmp_path, csv["ddp"], parquet["ddp_fc2"]) == parted  # one side of each
