"""Collective monitoring in real 2-rank gloo jobs started by torchrun.

tests/scripts/comm_train.py runs all_reduce (sync, twice per line, and async), all_gather,
reduce_scatter, broadcast, isend/irecv and batch_isend_irecv, and saves what each call had
before and after it. The expected statistics are computed here from those tensors, in float64.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ALL_OPS, ROOT, rank_dir, read_csv_rows, reference_stats

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "comm_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
SITE_OPS = {
    "grads": "all_reduce",
    "gather": "all_gather",
    "scatter": "reduce_scatter",
    "bcast": "broadcast",
    "isend": "isend",
    "irecv": "irecv",
    "batch": "batch_isend_irecv",
    "async": "all_reduce",
}
STEPS = 3


def site_lines() -> dict[str, int]:
    """Marker -> line number of the collective call carrying `# site:<marker>`."""
    lines = {}
    for number, text in enumerate(SCRIPT.read_text().splitlines(), start=1):
        match = re.search(r"# site:(\w+)", text)
        if match:
            lines[match.group(1)] = number
    assert set(lines) == set(SITE_OPS)
    return lines


LINES = site_lines()


def row_name(marker: str, phase: str) -> str:
    return f"{SITE_OPS[marker]}@comm_train.py[{LINES[marker]}]/{phase}"


class Job:
    def __init__(self, result: subprocess.CompletedProcess, out: Path, work: Path) -> None:
        self.result, self.out, self.work = result, out, work
        self.log = result.stdout + result.stderr

    def captured(self, rank: int) -> dict:
        return json.loads((self.work / f"captured_rank{rank}.json").read_text())


def run_job(work: Path, config: dict | None, *extra: str, timeout: int = 240) -> Job:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "monitor_output"
    args = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--out",
        str(work),
        *extra,
    ]
    if config is not None:
        path = work / "monitor.json"
        path.write_text(json.dumps(config))
        args += ["--config", str(path)]
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=work)
    return Job(result, out, work)


@pytest.fixture(scope="module")
def full_job(tmp_path_factory) -> Job:
    config = {
        "cc_distribution": {"enable": True, "cc_pre_hook": True},
        "format": ["csv", "tensorboard"],
        "ops": ALL_OPS,
    }
    job = run_job(tmp_path_factory.mktemp("cc_full"), config)
    assert job.result.returncode == 0, job.log[-4000:]
    return job


@pytest.fixture(scope="module")
def unmonitored_job(tmp_path_factory) -> Job:
    job = run_job(tmp_path_factory.mktemp("cc_none"), None)
    assert job.result.returncode == 0, job.log[-4000:]
    return job


@pytest.fixture(scope="module")
def filtered_job_with_failing_rank(tmp_path_factory) -> Job:
    """cc_codeline keeps two lines (one literal, one regex); rank 1's statistics fail."""
    config = {
        "cc_distribution": {
            "enable": True,
            "cc_codeline": [f"comm_train.py[{LINES['bcast']}]", rf"scripts/comm_\w+\.py\[{LINES['async']}\]"],
        },
        "format": "csv",
        "ops": ["norm", "max"],
    }
    return run_job(tmp_path_factory.mktemp("cc_filtered"), config, "--fail-rank", "1")


def expected_rows(captured: dict) -> dict[tuple[int, str], dict[str, float]]:
    """(step, row name) -> statistics of everything that went through that site and phase."""
    expected = {}
    for step, sites in enumerate(captured["steps"]):
        for marker, phases in sites.items():
            for phase, tensors in phases.items():
                if tensors:
                    flat = torch.cat([torch.tensor(t, dtype=torch.float64).flatten() for t in tensors])
                    expected[(step, row_name(marker, phase))] = reference_stats(flat)
    return expected


def assert_close(got: float, want: float, what) -> None:
    if math.isnan(want):
        assert math.isnan(got), what
    else:
        assert got == pytest.approx(want, rel=1e-5, abs=2e-6), what


def test_collective_statistics_equal_independently_computed_statistics(full_job):
    for rank in (0, 1):
        rows = read_csv_rows(rank_dir(full_job.out, rank), "other")
        expected = expected_rows(full_job.captured(rank))
        got = {(int(r["step"]), r["name"]): r for r in rows}
        assert set(got) == set(expected), (rank, sorted(set(got) ^ set(expected)))
        for (step, name), stats in expected.items():
            row = got[(step, name)]
            assert row["vpp_stage"] == "0"
            for op in ALL_OPS:
                assert_close(float(row[op]), stats[op], (rank, step, name, op))


def test_csv_rows_have_the_documented_columns(full_job):
    path = sorted(rank_dir(full_job.out, 0).glob("other_0-0.csv"))[0]
    header, first = path.read_text().splitlines()[:2]
    assert header.split(",") == ["vpp_stage", "name", "step", *ALL_OPS]
    assert first.split(",")[:3] == ["0", row_name("grads", "pre"), "0"]


def test_calls_from_one_line_combine_exactly_and_nested_calls_count_once(full_job):
    rows = {(int(r["step"]), r["name"]): r for r in read_csv_rows(rank_dir(full_job.out, 0), "other")}
    captured = full_job.captured(0)["steps"][0]
    # two all_reduce calls (weight, bias) on one line: the norm is sqrt of the summed squares
    norms = [torch.tensor(t, dtype=torch.float64).norm().item() for t in captured["grads"]["post"]]
    assert float(rows[(0, row_name("grads", "post"))]["norm"]) == pytest.approx(math.hypot(*norms), rel=1e-5)
    # batch_isend_irecv calls isend/irecv inside: its two tensors are counted once, and no
    # isend/irecv row appears for its line
    batch = rows[(0, row_name("batch", "post"))]
    assert float(batch["mean"]) == pytest.approx((0.5 + 1.5) / 2)
    assert not [name for _, name in rows if f"[{LINES['batch']}]" in name and "batch" not in name]


def test_nan_arriving_through_all_gather_is_counted_on_the_receiving_rank(full_job):
    rows = {(int(r["step"]), r["name"]): r for r in read_csv_rows(rank_dir(full_job.out, 0), "other")}
    assert float(rows[(1, row_name("gather", "pre"))]["nans"]) == 0  # rank 0 sent clean data
    assert float(rows[(1, row_name("gather", "post"))]["nans"]) == 1  # and received rank 1's NaN
    assert float(rows[(0, row_name("gather", "post"))]["nans"]) == 0


def test_tensorboard_tags_are_op_rank_phase_stat(full_job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rank_dir(full_job.out, 1)), size_guidance={"scalars": 0})
    acc.Reload()
    site = f"all_reduce@comm_train.py[{LINES['async']}]"
    tag = f"{site}/rank1/post_norm"
    assert tag in acc.Tags()["scalars"]
    assert f"{site}/rank1/pre_max" in acc.Tags()["scalars"]
    events = acc.Scalars(tag)
    assert [e.step for e in events] == list(range(STEPS))
    # all_reduce of (rank + 1) * (step + 1) over two ranks: 3 * (step + 1) in each of 4 elements
    assert [e.value for e in events] == pytest.approx([6.0 * (s + 1) for s in range(STEPS)], rel=1e-6)


def test_training_is_bit_identical_with_and_without_collective_monitoring(full_job, unmonitored_job):
    for rank in (0, 1):
        monitored, plain = full_job.captured(rank), unmonitored_job.captured(rank)
        assert monitored["losses"] == plain["losses"]
        assert monitored["weights"] == plain["weights"]
        assert monitored["steps"] == plain["steps"]


def test_cc_codeline_records_only_the_listed_lines(filtered_job_with_failing_rank):
    job = filtered_job_with_failing_rank
    rows = read_csv_rows(rank_dir(job.out, 0), "other")
    assert {r["name"] for r in rows} == {row_name("bcast", "post"), row_name("async", "post")}
    assert sorted(int(r["step"]) for r in rows) == sorted(list(range(STEPS)) * 2)
    assert list(rows[0]) == ["vpp_stage", "name", "step", "norm", "max"]


def test_one_ranks_monitor_failing_neither_deadlocks_nor_stops_training(
    filtered_job_with_failing_rank, unmonitored_job
):
    job = filtered_job_with_failing_rank
    assert job.result.returncode == 0, job.log[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} finished step {STEPS - 1}" in job.log
        assert job.captured(rank)["losses"] == unmonitored_job.captured(rank)["losses"]
    failures = [line for line in job.log.splitlines() if "collective communication monitoring failed" in line]
    assert len(failures) == 1 and "msmon[rank 1]" in failures[0], failures
    assert not read_csv_rows(rank_dir(job.out, 1), "other")


def test_cc_log_only_logs_each_collective_once_then_stops_cleanly(tmp_path):
    job = run_job(tmp_path, {"cc_distribution": {"enable": True, "cc_log_only": True}, "format": "csv"})
    assert job.result.returncode == 0, job.log[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} finished step 0" not in job.log  # stopped inside step 0's optimizer step
        logged = [line for line in job.log.splitlines() if line.startswith(f"msmon[rank {rank}] collective:")]
        sites = [re.search(r" at (\S+) ", line).group(1) for line in logged]
        # eight sites; the two all_reduce calls of the gradient loop differ in shape, so both show
        assert sorted(set(sites)) == sorted({f"comm_train.py[{line}]" for line in LINES.values()})
        assert len(logged) == len(set(logged)) == len(LINES) + 1
        grads = [line for line in logged if f"comm_train.py[{LINES['grads']}]" in line]
        assert {"shape=(2, 4)", "shape=(2,)"} == {re.search(r"shape=\([^)]*\)", line).group(0) for line in grads}
        assert all("dtype=float32" in line and "group ranks=[0, 1]" in line for line in logged)
        stops = [line for line in job.log.splitlines() if f"msmon[rank {rank}]: cc_log_only:" in line]
        assert len(stops) == 1 and f"{len(logged)} distinct collectives logged in step 0" in stops[0]
    assert "Traceback" not in job.log


def test_msmon_run_covers_a_library_that_copied_all_reduce_before_the_script_ran(tmp_path):
    """`msmon run` wraps torch.distributed when torch is imported, before any library can copy
    a collective; the unmodified script's own calls and the library's are both recorded."""
    scripts = SCRIPT.parent
    lib_line = next(
        n
        for n, text in enumerate((scripts / "comm_cached_lib.py").read_text().splitlines(), 1)
        if "# site:cached" in text
    )
    direct_line = next(
        n
        for n, text in enumerate((scripts / "comm_launched.py").read_text().splitlines(), 1)
        if "# site:direct" in text
    )
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"cc_distribution": {"enable": True}, "format": "csv", "ops": ["norm", "max"]}))
    out = tmp_path / "monitor_output"
    result = subprocess.run(
        [
            str(TORCHRUN.parent / "msmon"),
            "run",
            "--config",
            str(config),
            "--output-dir",
            str(out),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--",
            str(scripts / "comm_launched.py"),
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lib, direct = f"all_reduce@comm_cached_lib.py[{lib_line}]/post", f"all_reduce@comm_launched.py[{direct_line}]/post"
    per_rank = []
    for rank in (0, 1):
        rows = {
            (int(r["step"]), r["name"]): (float(r["norm"]), float(r["max"]))
            for r in read_csv_rows(rank_dir(out, rank), "other")
        }
        assert set(rows) == {(step, name) for step in (0, 1) for name in (lib, direct)}, rows
        # all_reduce of [rank + step] over ranks 0 and 1: 1 + 2 * step
        assert [rows[(step, direct)] for step in (0, 1)] == [(1.0, 1.0), (3.0, 3.0)]
        per_rank.append(rows)
    assert per_rank[0] == per_rank[1]  # an all_reduce leaves the same result on every rank
