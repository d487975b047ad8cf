"""`grad_reduced` is the gradient the optimizer consumes: after the framework clipped (and
unscaled) it inside its own `step()`, as it reaches the inner torch optimizer.

Each script registers its own step pre-hook on the torch optimizer that finally steps and sums
what it receives (squares, values, largest magnitude), in plain torch, across the ranks that
hold partitions; msmon's `grad_reduced` rows of the same run, combined over parameters, must give
the same global norm, sum and largest magnitude. Clipping is active in every run (the gradients'
norm before clipping is well above the threshold), so a row read before clipping fails.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import pytest
from test_deepspeed_e2e import assert_close, assert_loss_rows_are_the_scripts_losses, msmon_run, output_of, truth
from test_fsdp_e2e import run_script
from test_megatron_e2e import run_megatron_cpu

from conftest import rank_dir, read_csv_rows

pytestmark = pytest.mark.e2e

CONFIG = {"wg_distribution": True, "format": ["csv"], "ndigits": 12, "ops": ["min", "max", "norm", "mean"]}
STEPS = 3


def by_name(row: dict[str, str]) -> str:
    return row["name"]


def global_statistics(
    rows: list[dict[str, str]], numel: dict[str, int], key: Callable[[dict[str, str]], str] = by_name
) -> dict[int, dict[str, float]]:
    """Per step, from msmon's per-parameter rows: the norm, sum and largest magnitude of all of them."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        step = out.setdefault(int(row["step"]), {"squares": 0.0, "sum": 0.0, "absmax": 0.0})
        step["squares"] += float(row["norm"]) ** 2
        step["sum"] += float(row["mean"]) * numel[key(row)]
        step["absmax"] = max(step["absmax"], abs(float(row["min"])), abs(float(row["max"])))
    return {s: {"norm": math.sqrt(v["squares"]), "sum": v["sum"], "absmax": v["absmax"]} for s, v in out.items()}


def assert_consumed(
    recorded: dict[int, dict[str, float]], steps: list[dict], numel: dict[str, int], inner_steps: int = 1
) -> None:
    assert sorted(recorded) == list(range(len(steps)))
    elements = sum(numel.values())
    for index, expected in enumerate(steps):
        got = recorded[index]
        assert expected["inner_steps"] == inner_steps
        assert expected["unclipped_norm"] > 1.5  # clipping took effect on this step
        assert expected["norm"] == pytest.approx(1.0, rel=1e-4)  # clipped to gradient_clipping
        assert got["norm"] == pytest.approx(expected["norm"], rel=1e-5), (index, got, expected)
        assert got["absmax"] == pytest.approx(expected["absmax"], rel=1e-5), (index, got, expected)
        # a sum of float32 means times counts: its error is bounded by the values' magnitudes
        assert got["sum"] == pytest.approx(expected["sum"], abs=1e-5 * expected["norm"] * math.sqrt(elements))


# (stage, dtype) -> the optimizer DeepSpeed builds: stage 0 fp32 steps torch's AdamW itself, after
# the engine clipped; every other one clips inside its own step() and then steps the inner AdamW
DEEPSPEED_RUNS = {
    (0, "fp32"): "AdamW",
    (0, "bf16"): "FP16_UnfusedOptimizer",
    (1, "fp32"): "DeepSpeedZeroOptimizer",
    (1, "bf16"): "BF16_Optimizer",
    (2, "bf16"): "DeepSpeedZeroOptimizer",
    (3, "fp32"): "DeepSpeedZeroOptimizer_Stage3",
}


@pytest.mark.parametrize("run", sorted(DEEPSPEED_RUNS), ids=lambda run: f"stage{run[0]}-{run[1]}")
def test_deepspeed_grad_reduced_is_what_the_inner_optimizer_receives_after_gradient_clipping(run, tmp_path):
    stage, dtype = run
    work = tmp_path / f"ds{stage}{dtype}"
    args = ("--stage", str(stage), "--dtype", dtype, "--steps", str(STEPS), "--out", str(work))
    msmon_run(work, CONFIG, "ds_clipped.py", *args)
    expected = truth(work)
    assert expected["optimizer"] == DEEPSPEED_RUNS[run]
    rows = read_csv_rows(output_of(work, 0), "grad_reduced")
    assert {r["name"] for r in rows} == set(expected["numel"])
    # two parameter groups: ZeRO-1/2/3 step the inner AdamW once for each, every other one once
    inner_steps = 2 if expected["optimizer"] in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3") else 1
    assert_consumed(global_statistics(rows, expected["numel"]), expected["steps"], expected["numel"], inner_steps)
    assert not read_csv_rows(output_of(work, 1), "grad_reduced")  # written once, by the first rank


def megatron_key(row: dict[str, str]) -> str:
    return f"{row['vpp_stage']}:{row['name']}"


@pytest.mark.parametrize("case", ["fp32", "float16", "distributed", "chained"])
def test_megatron_grad_reduced_is_what_the_inner_optimizer_receives_after_clip_grad(case, tmp_path):
    """Megatron's step() copies main_grad to the main parameters (prepare_grads), unscales them
    (float16: a ConstantGradScaler of 1024, the backward through Megatron's backward_step),
    clips them (clip_grad_norm, or the ChainedOptimizer's clip over all of its optimizers) and
    only then steps each inner torch optimizer. The loss rows are the unscaled losses."""
    scaled = ("--loss-scale", "1024") if case == "float16" else ()
    config = dict(CONFIG, loss_distribution=True)
    run_megatron_cpu(tmp_path, config, case, "--clip", *scaled)
    expected = json.loads((tmp_path / "truth_rank0.json").read_text())
    assert expected["loss_scale"] == (1024.0 if scaled else 1.0)
    for rank in (0, 1):
        losses = json.loads((tmp_path / f"truth_rank{rank}.json").read_text())["losses"]
        assert_loss_rows_are_the_scripts_losses(rank_dir(tmp_path / "out", rank), losses, micro=2)
    rows = read_csv_rows(rank_dir(tmp_path / "out", 0), "grad_reduced")
    assert {megatron_key(r) for r in rows} == set(expected["numel"])
    steps = [step["consumed"] for step in expected["steps"]]
    assert_consumed(global_statistics(rows, expected["numel"], megatron_key), steps, expected["numel"])


def test_fsdp2_under_lightning_grad_reduced_is_what_adam_consumes_after_lightnings_gradient_clipping(tmp_path):
    """Lightning clips inside the closure it hands to `Adam.step(closure)`: msmon reads the
    gradients once that closure has run, so FSDP2's sharded gradients are read clipped."""
    work = tmp_path / "lightning"
    run_script(work, "fsdp_lightning.py", "--clip")
    expected = truth(work)
    assert len(expected["unclipped"]) == STEPS and min(expected["unclipped"]) > 1.5  # clipping took effect
    rows = read_csv_rows(output_of(work, 0), "grad_reduced")
    consumed = [step["grad_reduced"] for step in expected["consumed"]]
    assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted(
        (s, n) for s in range(STEPS) for n in consumed[0]
    )
    for row in rows:
        assert_close(row, consumed[int(row["step"])][row["name"]], row["name"])
    for step in range(STEPS):
        norm = math.sqrt(sum(float(r["norm"]) ** 2 for r in rows if int(r["step"]) == step))
        assert norm == pytest.approx(1.0, rel=1e-4)
    assert not read_csv_rows(output_of(work, 1), "grad_reduced")  # written once
