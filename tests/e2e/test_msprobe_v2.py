"""An msprobe V2 config file (26.2's TrainerMonitorV2: `monitors`, `rank`, `stop_step`) runs
unchanged under `msmon run`, and records what msprobe itself records with the same file.

The same 2-rank script (gloo, CPU) runs twice: under `msmon run --config v2.json`, and under
plain torchrun monitored by msprobe's own TrainerMonitorV2 (mindstudio-probe 26.2.0) reading
v2.json. msmon records only start_step <= step < stop_step, every monitor the file names, and
the same (step, module, scope) rows as msprobe with values within 1e-6 relative (msmon's CSV
holds 10 digits there: `ndigits`, msmon's own key, which V2 ignores). msprobe 26.2.0's
weight_grad monitor records no `unreduced` rows (its AccumulateGrad hooks sit on a node that is
freed before backward runs): msmon's grad_unreduced rows are the rows it has beyond msprobe's.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import platform
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_job

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "trackers_ddp.py"
STEPS = 5
START, STOP = 1, 4
MONITORS = {
    "module": {"enabled": True, "targets": ["fc"], "ops": ["min", "max", "norm"]},
    "weight_grad": {"enabled": True, "ops": ["norm"]},
    "param": {"enabled": True, "ops": ["norm", "mean"]},
    "optimizer": {"enabled": True},
    "cc": {"enabled": True},
}
# msmon category -> msprobe V2's scope, and how a row's name becomes V2's module_name
SCOPES = {
    "actv": "forward",
    "actv_grad": "backward",
    "grad_reduced": "reduced",
    "grad_unreduced": "unreduced",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}


def v2_name(category: str, name: str) -> str:
    if category in ("actv", "actv_grad"):  # fc1.input -> fc1.input.0; its gradient fc1.grad_input.0
        module, slot = name.rsplit(".", 1)
        return f"{module}.{slot if category == 'actv' else 'grad_' + slot}.0"
    return f"{name}.{category}" if category.startswith("exp_avg") else name


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("msprobe_v2")
    (base / "msprobe").mkdir()
    config = base / "v2.json"
    v2 = {"framework": "pytorch", "output_dir": str(base / "msprobe"), "rank": [0, 1], "start_step": START}
    config.write_text(json.dumps({**v2, "stop_step": STOP, "monitors": MONITORS, "ndigits": 10}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = ["--standalone", "--nproc-per-node", "2"]
    script = [str(SCRIPT), "--steps", str(STEPS)]
    msmon = [
        sys.executable,
        "-m",
        "msmon.launcher",
        "run",
        "--config",
        str(config),
        "--output-dir",
        str(base / "msmon"),
    ]
    proc = run_job([*msmon, *torchrun, "--", *script], timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = {"msmon": read_msmon(base / "msmon"), "stderr": proc.stderr}
    if _msprobe_installed():
        proc = run_job(
            [sys.executable, "-m", "torch.distributed.run", *torchrun, *script, "--v2", str(config)],
            timeout=240,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        found["msprobe"] = read_msprobe(base / "msprobe")
    return found


def _msprobe_installed() -> bool:
    try:
        import msprobe.core.monitor_v2  # noqa: F401
    except ImportError:
        return False
    return True


def rows_of(pattern: str) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted(glob.glob(pattern)):
        with open(path, newline="") as fh:
            rows.extend(csv.DictReader(fh))
    return rows


def read_msmon(out: Path) -> dict[int, dict[str, list[dict[str, str]]]]:
    """rank -> category -> rows."""
    found: dict[int, dict[str, list[dict[str, str]]]] = {}
    for directory in glob.glob(str(out / "*-rank*-*")):
        rank = int(Path(directory).name.split("-rank")[1].split("-")[0])
        for path in Path(directory).glob("*_[0-9]*.csv"):
            found.setdefault(rank, {}).setdefault(path.name.rsplit("_", 1)[0], []).extend(rows_of(str(path)))
    assert sorted(found) == [0, 1]
    return found


def read_msprobe(out: Path) -> dict[int, dict[tuple[int, str, str], dict[str, str]]]:
    """rank -> (step, module_name, scope) -> row, of the monitors both write alike."""
    found: dict[int, dict[tuple[int, str, str], dict[str, str]]] = {}
    for rank in (0, 1):
        for monitor in ("module", "weight_grad", "param", "optimizer"):
            for row in rows_of(str(out / f"rank_{rank}" / f"{monitor}_step*.csv")):
                found.setdefault(rank, {})[(int(row["step"]), row["module_name"], row["scope"])] = row
    return found


def test_a_v2_file_runs_unchanged_under_msmon_run_and_says_what_each_key_became(jobs):
    stderr = jobs["stderr"]
    for key in ("framework", "output_dir", "rank", "start_step", "stop_step", "monitors.module", "monitors.cc"):
        assert f"msmon: msprobe V2 {key} -> " in stderr, key
    assert "msmon: xy_name_contains ['fc'] selects the modules fc1, fc2" in stderr


def test_only_the_steps_from_start_step_to_before_stop_step_are_recorded_for_every_monitor(jobs):
    for rank, tables in jobs["msmon"].items():
        # module, weight_grad, param, optimizer, cc: every monitor the file names is recorded
        assert set(SCOPES) | {"other"} <= set(tables), (rank, sorted(tables))
        for category, rows in tables.items():
            assert {int(r["step"]) for r in rows} == set(range(START, STOP)), (rank, category)
        assert {r["name"].split("@")[0] for r in tables["other"]} >= {"all_reduce"}  # the script's collectives


def test_msmon_records_the_rows_msprobe_v2_records_with_the_same_values(jobs):
    if "msprobe" not in jobs:
        # msmon[test] installs it wherever its wheel exists (CPython 3.11, x86-64): there its absence is a failure
        if sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64":
            pytest.fail("mindstudio-probe (msprobe's TrainerMonitorV2) is not installed: pip install 'msmon[test]'")
        pytest.skip("mindstudio-probe 26.2.0 has a wheel for CPython 3.11 on x86-64 only")
    for rank in (0, 1):
        theirs = jobs["msprobe"][rank]
        ours: dict[tuple[int, str, str], dict[str, str]] = {}
        for category, scope in SCOPES.items():
            for row in jobs["msmon"][rank][category]:
                ours[(int(row["step"]), v2_name(category, row["name"]), scope)] = row
        assert not any(scope == "unreduced" for _, _, scope in theirs)  # msprobe 26.2.0 records none
        assert set(theirs) == {k for k in ours if k[2] != "unreduced"}, rank
        assert {step for step, _, _ in theirs} == set(range(START, STOP))
        for key, row in theirs.items():
            columns = [op for op in ("min", "max", "mean", "norm", "nans") if op in row]
            assert {c for c in ours[key] if c in ("min", "max", "mean", "norm", "nans")} == set(columns)  # its own ops
            for op in columns:
                assert float(ours[key][op]) == pytest.approx(float(row[op]), rel=1e-6, abs=1e-12), (rank, key, op)
