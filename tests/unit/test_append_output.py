"""append_output: a restarted job continues its earlier run's series in the same rank
directories, each step once (CSV rows and TensorBoard steps), the superseded rows kept aside."""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MLP, ROOT, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.config import ConfigError, parse_config

PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def prefix(directory: Path) -> str:
    return directory.name.split("-rank")[0]


def run(config: str, steps: int, start: int = 0, seed: int = 0) -> dict[int, dict[str, float]]:
    """A monitored job of `steps` steps from `start_iteration=start`; the gradient norms it had."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(config, params_have_main_grad=False)
    mon.set_monitor(model, optimizer, start_iteration=start)
    norms = {}
    for step in range(start, start + steps):
        model(torch.randn(5, 8)).square().mean().backward()
        norms[step] = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    return norms


def csv_norms(directory: Path, category: str = "grad_reduced") -> dict[tuple[int, str], list[float]]:
    seen: dict[tuple[int, str], list[float]] = {}
    for row in read_csv_rows(directory, category):
        seen.setdefault((int(row["step"]), row["name"]), []).append(float(row["norm"]))
    return seen


def tb_norms(directory: Path, tag: str = "0:fc1.weight/rank0/grad_reduced_norm") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


CONFIG = {"wg_distribution": True, "format": ["csv", "tensorboard"], "ndigits": 12, "step_count_per_record": 3}


def test_a_resumed_run_replaces_the_steps_it_trains_again_and_keeps_the_earlier_rows_aside(write_config, output_dir):
    first = run(write_config(CONFIG), 6)  # steps 0..5; a checkpoint at step 4, then a crash
    earlier = rank_dir(output_dir)
    resumed = dict(CONFIG, append_output=[prefix(earlier), prefix(earlier)])
    second = run(write_config(resumed, "resumed.json"), 4, start=4, seed=1)  # steps 4..7 again from the checkpoint
    assert glob.glob(str(output_dir / "*-rank0-*")) == [str(earlier)]

    seen = csv_norms(earlier)
    assert set(seen) == {(s, n) for s in range(8) for n in PARAMS}
    for (step, name), values in seen.items():
        truth = (first if step < 4 else second)[step][name]
        assert values == [pytest.approx(truth, rel=1e-6)], (step, name)
    aside = earlier / "superseded_from_step4"
    assert sorted(p.name for p in aside.iterdir()) == ["grad_reduced_3-5.csv", "grad_unreduced_3-5.csv"]
    kept = csv_norms(aside)
    assert set(kept) == {(s, n) for s in (4, 5) for n in PARAMS}
    assert kept[(5, "fc2.bias")] == [pytest.approx(first[5]["fc2.bias"], rel=1e-6)]

    # TensorBoard: the new events file starts with a restart marker at step 4
    assert len(list(earlier.glob("events.out.tfevents.*"))) == 2
    events = tb_norms(earlier)
    assert [s for s, _ in events] == list(range(8))
    for step, value in events:
        assert value == pytest.approx((first if step < 4 else second)[step]["fc1.weight"], rel=1e-6)
    # and so does `msmon convert tb2csv` of the directory
    from msmon.offline.convert.sources import find_ranks
    from msmon.offline.convert.tb_to_csv import tensorboard_to_csv

    tensorboard_to_csv(find_ranks(str(earlier))[0], str(output_dir.parent / "back"))
    back = csv_norms(output_dir.parent / "back" / earlier.name)
    assert set(back) == set(seen)
    assert all(back[k] == [pytest.approx(v[0], rel=1e-6)] for k, v in seen.items())


def test_a_resumed_run_without_a_start_step_continues_after_the_last_one(write_config, output_dir):
    run(write_config(CONFIG), 3)
    earlier = rank_dir(output_dir)
    resumed = dict(CONFIG, append_output=[prefix(earlier), None])  # an open end
    run(write_config(resumed, "resumed.json"), 2, seed=1)
    assert set(csv_norms(earlier)) == {(s, n) for s in range(5) for n in PARAMS}
    assert [s for s, _ in tb_norms(earlier)] == list(range(5))
    assert not list(earlier.glob("superseded_*"))
    summary = (earlier / "summary.json").read_text()
    assert json.loads(summary)["last_step"] == 4 and json.loads(summary)["next_step"] == 5  # steps 0-4
    assert summary.endswith("}\n")


def test_a_range_that_selects_no_directory_is_an_error_before_training(write_config, output_dir):
    run(write_config({"format": "csv", "wg_distribution": True}), 1)
    with pytest.raises(ConfigError, match="append_output: no output directory under .* between Jan01_00-00-00"):
        TrainerMon(write_config({"append_output": ["Jan01_00-00-00", "Jan01_00-00-01"]}, "resumed.json"))


def test_msmon_run_refuses_a_range_that_selects_nothing_before_starting_the_job(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"append_output": ["Jan01_00-00-00", "Jan01_00-00-01"]}))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "msmon.launcher",
            "run",
            "--config",
            str(config),
            "--output-dir",
            str(tmp_path / "out"),
            "--no-torchrun",
            "--",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "append_output: no output directory" in proc.stderr
    assert not marker.exists()


def test_a_rank_without_a_directory_in_the_range_writes_a_new_one(write_config, output_dir, caplog):
    other = output_dir / "Dec01_00-00-00-rank1-00000000"  # the range holds only another rank's directory
    other.mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    run(write_config(dict(CONFIG, append_output=["Dec01_00-00-00", "Dec01_00-00-00"])), 2)
    mine = rank_dir(output_dir)
    assert mine != other and set(csv_norms(mine)) == {(s, n) for s in range(2) for n in PARAMS}
    assert any("no directory of rank 0 lies in the range" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "value, fragment",
    [
        (["Dec03_21-34-40"], "expected [] or two time prefixes"),
        ("Dec03_21-34-40", "expected [] or two time prefixes"),
        (["Dec03 21:34:40", "Dec03_21-34-41"], "is not a time prefix"),
        (["Dec03_21-34-41", "Dec03_21-34-40"], "is later than the end"),
        ([None, None], "at least one end"),
        ([3, "Dec03_21-34-40"], "expected a time prefix"),
    ],
)
def test_bad_append_output_is_a_clear_error(value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config({"append_output": value})
    assert fragment in str(err.value)


def test_good_append_output_values_are_kept():
    assert parse_config({"append_output": []}).append_output == []
    assert parse_config({"append_output": ["Dec03_21-34-40", None]}).append_output == ["Dec03_21-34-40", None]


@pytest.mark.e2e
def test_a_restarted_two_rank_job_continues_each_ranks_series(tmp_path):
    """`msmon run` of an unmodified DDP script on 2 gloo ranks, then again with append_output."""
    out = tmp_path / "out"
    config = tmp_path / "monitor.json"
    script = ROOT / "tests" / "scripts" / "launcher_ddp.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")

    def msmon_run(cfg: dict, steps: int) -> None:
        config.write_text(json.dumps(cfg))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "msmon.launcher",
                "run",
                "--config",
                str(config),
                "--output-dir",
                str(out),
                "--standalone",
                "--nproc-per-node",
                "2",
                "--",
                str(script),
                "--steps",
                str(steps),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    base = {"wg_distribution": True, "format": "csv"}
    msmon_run(base, 3)
    dirs = {rank: rank_dir(out, rank) for rank in (0, 1)}
    times = sorted(prefix(d) for d in dirs.values())
    msmon_run(dict(base, append_output=[times[0], times[-1]]), 2)
    for rank, directory in dirs.items():
        assert glob.glob(str(out / f"*-rank{rank}-*")) == [str(directory)]
        rows = read_csv_rows(directory, "grad_unreduced")
        steps = sorted({int(r["step"]) for r in rows})
        assert steps == list(range(5)), (rank, steps)
        per_step = {s: sum(1 for r in rows if int(r["step"]) == s) for s in steps}
        assert len(set(per_step.values())) == 1, per_step  # every parameter once per step


def test_the_resumed_runs_events_are_read_after_the_earlier_ones_whatever_the_file_names(write_config, output_dir):
    """TensorBoard reads a directory's events files in name order; an earlier run's file whose
    name sorts after the new one (the same second and a larger pid or counter, or a clock a
    little ahead) must not be read as the newer one."""
    run(write_config(CONFIG), 4)
    earlier = rank_dir(output_dir)
    (old,) = earlier.glob("events.out.tfevents.*")
    parts = old.name.split(".")
    parts[3] = f"{int(time.time()) + 1:010d}"  # as if from the same second as the new one, or a clock ahead
    old.rename(earlier / ".".join(parts))
    resumed = dict(CONFIG, append_output=[prefix(earlier), prefix(earlier)])
    second = run(write_config(resumed, "resumed.json"), 2, start=2, seed=1)
    events = tb_norms(earlier)
    assert [s for s, _ in events] == [0, 1, 2, 3]
    assert events[2][1] == pytest.approx(second[2]["fc1.weight"], rel=1e-6)
