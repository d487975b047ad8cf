"""How `msmon diff` compares: relative differences per op, the floor, rank by rank when the
layouts match, one value per whole tensor and order statistics over ranks x micro-steps when
they do not, the first divergence in training order and what it implies."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from diff_outputs import base_value, changed, write_output
from msmon.launcher.cli import main
from msmon.offline.diff.tolerance import differences, dtype_of, storage_floor


def answer(tmp_path, *args) -> tuple[int, dict, str]:
    path = tmp_path / "answer.json"
    result = CliRunner().invoke(main, ["diff", *map(str, args), "--json", str(path)])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(path.read_text()), result.stdout


def test_relative_differences_scale_each_op_as_its_meaning_asks():
    ops = ["norm", "min", "max", "mean", "zeros", "nans"]
    same = differences(ops, [2.0, -1.0, 1.0, 0.001, 0.5, 0.0], [2.0, -1.0, 1.0, 0.001, 0.5, 0.0])
    assert same == [0.0] * 6
    rel = differences(ops, [2.0, -1.0, 1.0, 0.001, 0.5, 0.0], [2.002, -1.0, 1.0, 0.0011, 0.25, 1.0])
    assert rel[0] == pytest.approx(0.002 / 2.002)
    assert rel[3] == pytest.approx(0.0001)  # a mean near zero, over its tensor's magnitude (max |min|, |max|)
    assert rel[4] == pytest.approx(0.25)  # a fraction: its own difference
    assert rel[5] == math.inf  # a count that changed
    assert differences(["norm"], [math.nan], [math.nan]) == [0.0]
    assert differences(["norm"], [1.0], [math.inf]) == [math.inf]


def test_the_floor_is_the_coarsest_parameter_dtype_or_the_stored_digits():
    assert dtype_of(["float32", "bfloat16"]) == "bfloat16" and dtype_of([]) == "float32"
    assert storage_floor(["csv"], 6) == pytest.approx(1e-5)
    assert storage_floor(["tensorboard"], 6) == pytest.approx(2.4e-7)


def test_one_changed_value_among_many_ranks_is_found_with_its_step_tensor_and_rank(tmp_path):
    a = write_output(tmp_path / "a", ranks=8, steps=5)
    b = write_output(tmp_path / "b", ranks=8, steps=5, value=changed("grad_reduced", "fc2.weight", 3, rank=6))
    code, data, text = answer(tmp_path, a, b)
    assert code == 1
    first = data["first_divergence"]
    assert (first["step"], first["category"], first["name"], first["rank"]) == (3, "grad_reduced", "fc2.weight", 6)
    assert first["relative_difference"] == pytest.approx(1e-3, rel=0.01)
    assert data["compared"]["files_identical"] == 8 * 5 * 7 - 2  # the two changed files alone were parsed
    assert data["compared"]["values"] == 8 * 5 * 18 * 4 and data["compared"]["tensors"] == 18
    assert [row["step"] for row in data["front"] if row["over"]] == [3, 4]
    assert "the communication: the reduced gradient differs while the rank-local gradients agree" in text


def test_the_first_divergence_is_the_earliest_in_training_order_not_the_largest(tmp_path):
    a = write_output(tmp_path / "a")

    def value(c, n, s, r, m):  # at step 1: fc2's output slightly, the updated weights a lot
        base = base_value(c, n, s, r, m)
        if s >= 1 and (c, n) == ("actv", "fc2.output"):
            return base * 1.0001
        if s >= 1 and c == "param_updated":
            return base * 1.1
        return base

    code, data, text = answer(tmp_path, a, write_output(tmp_path / "b", value=value))
    first = data["first_divergence"]
    assert code == 1 and (first["step"], first["name"], first["rank"]) == (1, "fc2.output", 0)
    assert data["front"][1]["largest"]["category"] == "param_updated"
    assert data["interpretation"].startswith("numerics in fc2's forward: its output differs")


@pytest.mark.parametrize(
    "category, name, implies",
    [
        ("param_origin", "fc1.weight", "the starting weights differ"),
        ("actv", "fc1.input", "the data: the input of fc1"),
        ("actv_grad", "fc1.output_grad", "numerics in fc1's backward"),
        ("grad_unreduced", "fc1.weight", "the weight gradients' computation"),
        ("exp_avg", "fc1.weight", "the optimizer: its state differs while the gradients agree"),
        ("param_updated", "fc2.weight", "the optimizer step or the learning rate"),
    ],
)
def test_the_one_line_says_what_the_first_category_to_part_implies(tmp_path, category, name, implies):
    a = write_output(tmp_path / "a")
    code, data, _ = answer(tmp_path, a, write_output(tmp_path / "b", value=changed(category, name, 0)))
    assert code == 1 and data["first_divergence"]["category"] == category
    assert data["interpretation"].startswith(implies), data["interpretation"]


def test_tolerance_modes_exact_rtol_and_the_default_floor(tmp_path):
    a = write_output(tmp_path / "a")
    b = write_output(tmp_path / "b", value=changed("exp_avg", "fc1.weight", 2, factor=1.0001))
    code, data, text = answer(tmp_path, a, b)
    assert code == 1 and data["tolerance"]["default"] and data["tolerance"]["limit"] == pytest.approx(1e-5)
    assert "tolerance: relative 1e-05, the floor of the runs' float32 and stored digits (the default" in text
    code, data, text = answer(tmp_path, a, b, "--rtol", "1e-3")
    assert code == 0 and "within tolerance over 3 steps x 18 tensors" in text
    assert not data["identical"] and data["first_divergence"] is None
    code, data, text = answer(tmp_path, a, b, "--rtol", "1e-9")
    assert "raised from --rtol 1e-09 to the floor" in text
    code, _, text = answer(tmp_path, a, write_output(tmp_path / "c"), "--exact")
    assert code == 0 and "identical over 3 steps x 18 tensors (432 values)" in text


def test_a_bfloat16_job_gets_the_floor_of_bfloat16(tmp_path):
    job = {"world_size": 2, "param_dtypes": {"bfloat16": 2}}
    a = write_output(tmp_path / "a", job=job)
    b = write_output(tmp_path / "b", job=job, value=changed("exp_avg", "fc1.weight", 2, factor=1.001))
    code, data, _ = answer(tmp_path, a, b)
    assert code == 0 and data["tolerance"]["dtype"] == "bfloat16" and data["tolerance"]["limit"] == 2**-7


def test_across_layouts_whole_tensors_are_one_value_and_rank_local_ones_order_statistics(tmp_path):
    """A: 2 ranks x 2 micro-steps; B: one process x 4 micro-steps on the same micro-batches, so
    the activations of B's micro-step 2r+m are A's rank r, micro-step m."""

    def one_process(c, n, s, r, m):
        return base_value(c, n, s, m // 2, m % 2)

    a = write_output(tmp_path / "a", ranks=2, micro_steps=2)
    b = write_output(tmp_path / "b", ranks=1, micro_steps=4, value=one_process)
    code, data, text = answer(tmp_path, a, b)
    assert not data["layout"]["same"]
    assert data["comparison"]["grad_reduced"] == "one value per tensor"
    assert data["comparison"]["actv"] == "order statistics over ranks x micro-steps (min, median, max)"
    assert "not counted: its scale follows the micro-steps per step (2 against 4" in data["comparison"]["actv_grad"]
    assert code == 0, text
    fronts = [row["categories"]["actv"] for row in data["front"]]
    assert all(f["compared"] == 4 * 3 and f["over"] == 0 for f in fronts)  # 4 tensors x (min, median, max)
    # one rank's copy of a whole tensor that drifts is caught against the other layout
    drift = write_output(tmp_path / "drift", ranks=2, micro_steps=2, value=changed("param_updated", "fc1.weight", 1, 1))
    code, data, _ = answer(tmp_path, drift, b)
    first = data["first_divergence"]
    assert code == 1 and (first["category"], first["statistic"], first["a_rank"], first["step"]) == (
        "param_updated",
        "tensor",
        1,
        1,
    )


def test_rows_on_one_side_only_are_counted_and_said(tmp_path):
    a = write_output(tmp_path / "a", steps=4)
    code, data, text = answer(tmp_path, a, write_output(tmp_path / "b", steps=3))
    assert code == 0 and "identical over 4 steps x 18 tensors" not in text
    assert sum(data["compared"]["rows_only_in_a"].values()) == 2 * 18 and "rows only on one side" in text


def test_reading_ranks_in_parallel_processes_gives_the_answer_one_process_gives(tmp_path):
    a = write_output(tmp_path / "a", ranks=20, steps=2)
    b = write_output(tmp_path / "b", ranks=20, steps=2, value=changed("actv", "fc1.output", 1, rank=17))
    answers = [answer(tmp_path, a, b, "-j", jobs)[1] for jobs in (1, 2)]
    for data in answers:
        data.pop("a"), data.pop("b")
    assert answers[0] == answers[1]
    first = answers[1]["first_divergence"]
    assert (first["step"], first["name"], first["rank"]) == (1, "fc1.output", 17)
    assert answers[1]["compared"]["files_identical"] == 20 * 2 * 7 - 1
