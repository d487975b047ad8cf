"""Ranks combining sharded statistics switch to an edited config at the same step, whichever
step each rank reads the edit at (agreement.py): the all_gathers stay in step, nothing hangs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ALL_OPS, ROOT, precision_slack, rank_dir, read_csv_rows
from msmon.config import load_config, parse_config
from msmon.runtime.agreement import choose_domain, config_hash, decision

SCRIPTS = ROOT / "tests" / "scripts"


def ds_env(**extra: str) -> dict[str, str]:
    """DeepSpeed on CPU (docs/frameworks.md), without the caller's msmon settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def test_the_config_hash_follows_the_settings_not_the_files_layout(tmp_path):
    (tmp_path / "a.json").write_text('{"ops": ["norm", "max"], "wg_distribution": true}')
    (tmp_path / "b.yaml").write_text("wg_distribution: true\nops:\n  - norm\n  - max\n")
    a, b = load_config(tmp_path / "a.json"), load_config(tmp_path / "b.yaml")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(parse_config({"ops": ["norm"], "wg_distribution": True}))
    assert 0 < config_hash(a) < 2**52 and float(config_hash(a)) == config_hash(a)  # exact as a float64


def test_the_agreement_group_is_the_one_holding_every_other():
    assert choose_domain([[0, 1, 2, 3], [0, 2]]) == 0  # expert data-parallel inside data-parallel
    assert choose_domain([[0, 2], [0, 1, 2, 3]]) == 1
    assert choose_domain([[0, 1], [0, 2]]) is None  # groups that do not nest: no common step
    assert choose_domain([]) is None


def test_an_edit_is_agreed_only_when_every_rank_proposes_it():
    assert decision([7.0, 7.0]) == 7
    assert decision([7.0, 0.0]) is None
    assert decision([7.0, 9.0]) is None
    assert decision([0.0, 0.0]) is None


def test_two_ranks_apply_each_edit_once_at_the_same_step_whatever_step_each_reads_it(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(SCRIPTS / "agreement_rounds.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ds_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied = [json.loads((tmp_path / f"agreed_rank{r}.json").read_text()) for r in (0, 1)]
    assert applied[0] == applied[1]
    assert applied[0] == {
        "read-at-different-steps": [[6, "B"]],  # read at 2 and 4; every rank's number in round 5, read at 6
        "a-newer-edit-wins": [[8, "C"]],  # B was never read by rank 1
        "read-together-applied-once": [[2, "D"]],  # the round in flight at step 2 is set aside
        "saved-again-applied-again": [[2, "D"], [7, "D"]],  # msprobe's dynamic_on: a new save collects again
        "never-read-by-one-rank": [],
    }
    assert "msmon[rank 0]: the edited config waits for ranks [1]" in proc.stderr


BEFORE = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "format": ["csv"],
    "ndigits": 12,
    "ops": ["norm"],
    "step_interval": 2,
}
AFTER = {**BEFORE, "ops": ALL_OPS, "step_interval": 1}
EDIT_AT = (3, 5)  # rank 0 reads the edit at the end of step 3, rank 1 at the end of step 5
STEPS = 12
SPLIT = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")


def close(row: dict[str, str], expected: dict[str, float], scale: float, what: str) -> None:
    """Float32 kernels against DeepSpeed's whole tensors in float64: relative 1e-5 (a mean of
    values that cancel judged against the values' magnitude)."""
    for op, value in expected.items():
        slack = 1e-5 * scale if op == "mean" else precision_slack(op, expected)
        assert float(row[op]) == pytest.approx(value, rel=1e-5, abs=1.5e-12 + slack), (what, op)


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_ranks_reading_an_edit_at_different_steps_switch_at_the_same_step(stage, tmp_path):
    """Without agreement rank 0 would switch at step 4: its gathers would carry 7 statistics
    where rank 1's carry 1, and at step 5 it would gather alone (rank 1 still records every
    other step)."""
    (tmp_path / "before.json").write_text(json.dumps(BEFORE))  # each rank's config is made from it at start
    (tmp_path / "edited.json").write_text(json.dumps(AFTER))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "ds_reload.py"),
        "--work",
        str(tmp_path),
        "--stage",
        str(stage),
        "--steps",
        str(STEPS),
        "--edit-at",
        *map(str, EDIT_AT),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ds_env(MONITOR_OUTPUT_DIR=str(out))
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "combining sharded statistics failed" not in proc.stderr
    switched = {
        int(r): int(s) for r, s in re.findall(r"msmon\[rank (\d)\]: config reloaded at step (\d+)", proc.stderr)
    }
    assert set(switched) == {0, 1} and switched[0] == switched[1], proc.stderr[-3000:]
    first = switched[0]  # the first step under the edited config
    assert EDIT_AT[1] < first <= EDIT_AT[1] + 3
    expected_steps = {s for s in range(first) if s % 2 == 0} | set(range(first, STEPS))
    truth = json.loads((tmp_path / "truth_rank0.json").read_text())["steps"]
    writer = rank_dir(out, 0)
    for category in SPLIT:
        rows = read_csv_rows(writer, category)
        assert {int(r["step"]) for r in rows} == expected_steps, category
        for row in rows:
            step = int(row["step"])
            ops = ALL_OPS if step >= first else ["norm"]
            assert [op for op in ALL_OPS if op in row] == ops, (category, step)
            expected = truth[step][category][row["name"]]
            close(
                row,
                {op: expected[op] for op in ops},
                max(abs(expected["min"]), abs(expected["max"])),
                f"{category} {row['name']} step {step}",
            )
    local = read_csv_rows(rank_dir(out, 1), "grad_unreduced")  # rank 1 writes only its rank-local gradients
    assert {int(r["step"]) for r in local} == expected_steps
    assert {int(r["step"]) for r in local if "max" in r} == set(range(first, STEPS))
    assert not any(
        math.isnan(float(v)) for r in read_csv_rows(writer, "grad_reduced") for k, v in r.items() if k in ALL_OPS
    )
