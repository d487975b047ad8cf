"""DeepSpeed ZeRO stages 0-3 under `msmon run`, for real: 2 CPU ranks on gloo, no monitoring code
in the scripts, the adapter chosen from the optimizer's class.

The truth is what DeepSpeed itself assembles in the same run (`safe_get_full_fp32_param`,
`safe_get_full_grad`, `safe_get_full_optimizer_state`, gathered whole on every rank), while
msmon only ever reads each rank's own partition and combines statistics. For fp32 runs the
rank-local gradients are checked against an unwrapped copy of the model fed the same batches.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ALL_OPS, ROOT, assert_agreement_rows_are, precision_slack, read_csv_rows

pytestmark = pytest.mark.e2e

SCRIPTS = ROOT / "tests" / "scripts"
CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "mg_direction": True,
    "loss_distribution": True,
    "grad_agreement": True,
    "format": ["csv"],
    "ndigits": 12,
    "squash_name": False,
    "ops": ALL_OPS,
}
REPLICATED = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
PARAMS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
STEPS = 3
# (stage, dtype) -> the optimizer DeepSpeed builds, hence the adapter msmon must pick
RUNS = {
    (0, "fp32"): "AdamW",
    (0, "bf16"): "FP16_UnfusedOptimizer",
    (1, "fp32"): "DeepSpeedZeroOptimizer",
    (1, "bf16"): "BF16_Optimizer",
    (2, "bf16"): "DeepSpeedZeroOptimizer",
    (3, "fp32"): "DeepSpeedZeroOptimizer_Stage3",
    (3, "bf16"): "DeepSpeedZeroOptimizer_Stage3",
}


def ds_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def msmon_run(work: Path, config: dict, script: str, *args: str) -> subprocess.CompletedProcess:
    """`msmon run` of an unmodified script on 2 ranks; the first DeepSpeed run of a machine also
    JIT-builds DeepSpeed's small shared-memory op (cached afterwards), hence the timeout."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "monitor.json"
    path.write_text(json.dumps(config))
    argv = [
        sys.executable,
        "-m",
        "msmon.launcher",
        "run",
        "--config",
        str(path),
        "--output-dir",
        str(work / "out"),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        str(SCRIPTS / script),
        *args,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=ds_env(), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def output_of(work: Path, rank: int) -> Path:
    """The rank's directory with recorded steps (a client optimizer released to DeepSpeed's
    monitor leaves one with nothing but its config and summary)."""
    dirs = [
        Path(d)
        for d in glob.glob(str(work / "out" / f"*-rank{rank}-*"))
        if json.loads((Path(d) / "summary.json").read_text())["steps_recorded"] > 0
    ]
    assert len(dirs) == 1, dirs
    return dirs[0]


def assert_loss_rows_are_the_scripts_losses(directory: Path, losses: list[float], micro: int) -> None:
    """One `loss` row per step and micro-step, equal to the loss the script computed there
    (`loss.item()`, in the order of its backward calls) to the CSV's 12 digits."""
    rows = read_csv_rows(directory, "loss")
    got = {(int(r["step"]), int(r["micro_step"])): float(r["value"]) for r in rows}
    expected = {(i // micro, i % micro): value for i, value in enumerate(losses)}
    assert len(rows) == len(got) and got.keys() == expected.keys(), sorted(got)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=0, abs=1e-12), (key, got[key], value)


def assert_grad_agreement_said_once_and_not_recorded(log: str, directories: dict[int, Path], framework: str) -> None:
    """Under DeepSpeed and Megatron the agreement is not recorded: one line per rank says why,
    naming the framework (its own reduction buffers; DeepSpeed's stage 0: no DDP module)."""
    for rank, directory in directories.items():
        said = f"msmon[rank {rank}]: grad_agreement is not recorded: "
        assert log.count(said) == 1, log[-3000:]
        assert framework in log.split(said, 1)[1].splitlines()[0]
        assert not read_csv_rows(directory, "grad_agreement")


def truth(work: Path, rank: int = 0) -> dict:
    return json.loads((work / f"truth_rank{rank}.json").read_text())


def assert_close(row: dict[str, str], expected: dict[str, float], what: str) -> None:
    """Float32 kernels against a float64 reference: relative 1e-5; a mean of values that
    cancel is judged against the values' magnitude, not the mean's (a std: conftest's precision_slack)."""
    for op, value in expected.items():
        got = float(row[op])
        if math.isnan(value):
            assert math.isnan(got), (what, op)
            continue
        slack = precision_slack(op, expected)
        assert got == pytest.approx(value, rel=1e-5, abs=1.5e-12 + slack), (what, op, got, value)


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda run: f"stage{run[0]}-{run[1]}")
def ds_job(request, tmp_path_factory):
    stage, dtype = request.param
    work = tmp_path_factory.mktemp(f"ds{stage}{dtype}")
    proc = msmon_run(
        work, CONFIG, "ds_train.py", "--stage", str(stage), "--dtype", dtype, "--steps", str(STEPS), "--out", str(work)
    )
    return stage, dtype, work, proc


def test_deepspeed_builds_the_optimizer_the_adapter_is_chosen_for(ds_job):
    stage, dtype, work, proc = ds_job
    assert truth(work)["optimizer"] == RUNS[(stage, dtype)]
    for rank in (0, 1):
        assert (
            f"msmon[rank {rank}]: monitoring {RUNS[(stage, dtype)]} of MLP (attached at deepspeed.initialize)"
            in proc.stderr
        )


def test_loss_rows_are_each_ranks_unscaled_micro_step_losses_and_grad_agreement_where_a_rank_holds_it(ds_job):
    """engine.backward(loss) runs backward on loss / gradient_accumulation_steps (times the loss
    scale in fp16): the rows hold the loss the script handed it. At stage 0 the engine all-reduces
    `.grad` in place, so the agreement rows are the script's own cos and norm ratio; at ZeRO-1 to 3
    no rank holds the whole reduced gradient, and one line per rank says so."""
    stage, _, work, proc = ds_job
    directories = {rank: output_of(work, rank) for rank in (0, 1)}
    for rank, directory in directories.items():
        assert_loss_rows_are_the_scripts_losses(directory, truth(work, rank)["losses"], micro=2)
    assert truth(work, 0)["losses"] != truth(work, 1)["losses"]  # each rank its own batches
    if stage != 0:
        assert_grad_agreement_said_once_and_not_recorded(proc.stderr, directories, "DeepSpeed")
        return
    assert "grad_agreement is not recorded" not in proc.stderr
    for rank, directory in directories.items():
        rows = read_csv_rows(directory, "grad_agreement")
        expected = truth(work, rank)["agreement"]
        assert len(expected) == STEPS
        assert_agreement_rows_are(rows, expected)
        assert all(c < 1 for c, _ in expected)  # each rank's own batches: the average departs from them


def test_loss_rows_are_unscaled_under_torch_autocast_float16_loss_scaling(tmp_path):
    """ZeRO-1 under `torch_autocast` float16 scales with torch's GradScaler (fp16 proper needs a
    device: this CPU has no float16 kernels). Even micro-steps go through engine.backward(loss),
    odd ones through DeepSpeed's torch-style `engine.scale(loss).backward()`: never the scaled
    value is recorded."""
    work = tmp_path / "autocast"
    config = {
        "wg_distribution": True,  # grad_agreement's gradients
        "loss_distribution": True,
        "grad_agreement": True,
        "format": ["csv"],
        "ndigits": 12,
    }
    proc = msmon_run(
        work,
        config,
        "ds_train.py",
        "--stage",
        "1",
        "--dtype",
        "autocast16",
        "--manual-backward",
        "--steps",
        "2",
        "--out",
        str(work),
    )
    directories = {rank: output_of(work, rank) for rank in (0, 1)}
    for rank, directory in directories.items():
        expected = truth(work, rank)
        assert_loss_rows_are_the_scripts_losses(directory, expected["losses"], micro=2)
        # the scaler did scale what backward ran on (2**16, GradScaler's initial scale)
        assert expected["scaled_losses"] == [loss * 2**16 for loss in expected["losses"][1::2]]
    assert_grad_agreement_said_once_and_not_recorded(proc.stderr, directories, "DeepSpeed")


def test_weights_gradients_and_moments_equal_deepspeeds_own_full_tensors(ds_job):
    _, _, work, _ = ds_job
    steps = truth(work)["steps"]
    directory = output_of(work, 0)
    for category in REPLICATED:
        rows = read_csv_rows(directory, category)
        assert {(int(r["step"]), r["name"]) for r in rows} == {(s, n) for s in range(STEPS) for n in PARAMS}, category
        for row in rows:
            assert_close(row, steps[int(row["step"])][category][row["name"]], f"{category} {row['name']}")


def test_mg_direction_equals_the_share_of_deepspeeds_full_gradient_and_momentum(ds_job):
    """Each rank counts matching signs in its own partition; the counts are summed across ranks."""
    _, _, work, _ = ds_job
    steps = truth(work)["steps"]
    rows = read_csv_rows(output_of(work, 0), "other")
    # from the first step that has a momentum (DeepSpeed's stage-0 wrappers create zero moments up front)
    present = {(s, n) for s in range(STEPS) for n in PARAMS if steps[s]["mg_direction"][n] is not None}
    assert {(s, n) for s in range(1, STEPS) for n in PARAMS} <= present
    assert {(int(r["step"]), r["name"]) for r in rows} == present
    for row in rows:
        share = steps[int(row["step"])]["mg_direction"][row["name"]]
        assert float(row["mean"]) == pytest.approx(share, abs=1e-12), row
    assert not read_csv_rows(output_of(work, 1), "other")  # written once, by the first data-parallel rank


def test_replicated_tensors_are_written_once_by_the_first_data_parallel_rank(ds_job):
    _, _, work, _ = ds_job
    directory = output_of(work, 1)
    for category in REPLICATED:
        assert not read_csv_rows(directory, category), category
    assert read_csv_rows(directory, "grad_unreduced")


def test_rank_local_gradients_are_written_by_every_rank_before_the_reduction(ds_job):
    stage, dtype, work, _ = ds_job
    seen = {}
    for rank in (0, 1):
        rows = read_csv_rows(output_of(work, rank), "grad_unreduced")
        assert {(int(r["step"]), r["name"]) for r in rows} == {(s, n) for s in range(STEPS) for n in PARAMS}
        seen[rank] = {(r["step"], r["name"]): r["norm"] for r in rows}
        if dtype == "fp32":  # ZeRO-2/3 reduce every micro-batch: the last one is reported; others accumulate
            local = "local_last" if stage >= 2 else "local_acc"
            for row in rows:
                assert_close(row, truth(work, rank)["steps"][int(row["step"])][local][row["name"]], row["name"])
    assert seen[0] != seen[1]  # different batches on the two ranks


def test_hf_trainer_with_deepspeed_zero3_is_monitored_without_code(tmp_path):
    work = tmp_path / "hf"
    config = dict(CONFIG, ur_distribution=False)
    proc = msmon_run(work, config, "ds_hf_trainer.py", "--output", str(work), "--stage", "3")
    assert "monitoring DeepSpeedZeroOptimizer_Stage3 of GPT2LMHeadModel" in proc.stderr
    steps = truth(work)["steps"]
    directory = output_of(work, 0)
    names = set(steps[0]["param_updated"])
    for category in ("param_updated", "exp_avg", "exp_avg_sq"):
        rows = read_csv_rows(directory, category)
        assert {(int(r["step"]), r["name"]) for r in rows} == {(s, n) for s in range(3) for n in names}, category
        for row in rows:
            assert_close(row, steps[int(row["step"])][category][row["name"]], f"{category} {row['name']}")
    assert not read_csv_rows(output_of(work, 1), "param_updated")


@pytest.mark.parametrize(
    ("stage", "dtype"), [("3", "bf16"), ("0", "fp32")], ids=["zero3-bf16", "stage0-fp32-agreement"]
)
def test_losses_are_bit_identical_with_and_without_monitoring(tmp_path, stage, dtype):
    """Stage 0 is where grad_agreement copies the gradients around the engine's all-reduce."""
    plain = tmp_path / "plain"
    plain.mkdir()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "ds_train.py"),
        "--stage",
        stage,
        "--dtype",
        dtype,
        "--out",
        str(plain),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=ds_env(), cwd=plain)
    assert proc.returncode == 0, proc.stderr[-4000:]
    monitored = tmp_path / "monitored"
    msmon_run(monitored, CONFIG, "ds_train.py", "--stage", stage, "--dtype", dtype, "--out", str(monitored))
    for rank in (0, 1):
        assert truth(monitored, rank)["losses"] == truth(plain, rank)["losses"]


def test_per_micro_batch_rank_local_gradients_under_zero2(tmp_path):
    """ZeRO-2 reduces after every micro-batch: with monitor_mbs_grad each reduction is a row."""
    work = tmp_path / "mbs"
    msmon_run(
        work, dict(CONFIG, monitor_mbs_grad=True), "ds_train.py", "--stage", "2", "--steps", "2", "--out", str(work)
    )
    steps = truth(work)["steps"]
    rows = read_csv_rows(output_of(work, 0), "grad_unreduced")
    assert {(int(r["step"]), int(r["micro_step"]), r["name"]) for r in rows} == {
        (s, m, n) for s in range(2) for m in range(2) for n in PARAMS
    }
    for row in rows:
        if row["micro_step"] == "1":  # the last micro-batch's gradient, which the script keeps
            assert_close(row, steps[int(row["step"])]["local_last"][row["name"]], row["name"])


def test_module_ranks_leaving_out_a_partition_holder_records_no_split_tensor_and_never_hangs(tmp_path):
    work = tmp_path / "ranks"
    proc = msmon_run(
        work, dict(CONFIG, module_ranks=[0]), "ds_train.py", "--stage", "1", "--steps", "2", "--out", str(work)
    )
    assert "module_ranks leaves out ranks [1]" in proc.stderr
    directory = output_of(work, 0)
    for category in REPLICATED:
        assert not read_csv_rows(directory, category), category
    assert read_csv_rows(directory, "grad_unreduced")  # rank-local: nothing to combine
