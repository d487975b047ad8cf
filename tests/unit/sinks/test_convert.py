"""`msmon convert`: a real monitored run's CSV -> TensorBoard -> CSV gives back its files, the
TensorBoard side read with tensorboard's own reader and tagged as the live sink tags."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ALL_OPS, MLP, ROOT, rank_dir
from msmon import TrainerMon
from msmon.offline.convert.csv_to_tb import csv_to_tensorboard
from msmon.offline.convert.sources import RankSource, find_ranks
from msmon.offline.convert.tags import Row, msmon_tag, parse_msmon_tag
from msmon.offline.convert.tb_to_csv import tensorboard_to_csv
from msmon.output.resume import csv_windows

FULL = {
    "wg_distribution": True,
    "monitor_mbs_grad": True,
    "param_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "mg_direction": True,
    "xy_distribution": True,
    "all_xy": True,
    "format": ["csv", "tensorboard"],
    "ops": ALL_OPS,
    "ndigits": 8,
    "step_count_per_record": 2,
}


def monitored_run(write_config, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config(FULL), params_have_main_grad=False)
    mon.set_monitor(model, optimizer, grad_acc_steps=2)
    for _ in range(steps):
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()


def csv_files(directory: Path) -> dict[str, list[list[str]]]:
    out = {}
    for path, _ in csv_windows(str(directory)):
        with open(path, newline="", encoding="utf-8") as fh:
            out[os.path.basename(path)] = list(csv.reader(fh))
    return out


def tb_values(directory: Path) -> dict[tuple[str, int], float]:
    """Every scalar of a directory, read with tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    values = {(t, e.step): e.value for t in acc.Tags()["scalars"] for e in acc.Scalars(t)}
    values.update(
        {
            (t, e.step): tensor_util.make_ndarray(e.tensor_proto).item()
            for t in acc.Tags()["tensors"]
            for e in acc.Tensors(t)
        }
    )
    return values


def msmon_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "convert", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_csv_to_tensorboard_to_csv_gives_back_a_real_runs_files(write_config, output_dir, tmp_path):
    monitored_run(write_config)
    source = rank_dir(output_dir)
    original = csv_files(source)
    assert {"other_2-3.csv", "actv_0-1.csv", "actv_grad_2-3.csv", "ratio_0-1.csv", "grad_unreduced_0-1.csv"} <= set(
        original
    )

    proc = msmon_cli("csv2tb", "-d", str(output_dir), "-o", str(tmp_path / "tb"))
    assert proc.returncode == 0, proc.stderr
    converted = tmp_path / "tb" / source.name
    values = tb_values(converted)
    live = tb_values(source)
    # the live sink's tags, histograms aside; the CSV's every digit (float64 tensor scalars)
    assert {tag for tag, _ in values} == {tag for tag, _ in live}
    for (tag, step), value in values.items():
        assert live[(tag, step)] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), tag
    assert ("0:fc1.weight/rank0/mg_direction_mean", 1) in values
    assert ("0:fc1.weight:1/rank0/grad_unreduced_norm", 0) in values

    proc = msmon_cli("tb2csv", "-d", str(tmp_path / "tb"), "-o", str(tmp_path / "csv"))
    assert proc.returncode == 0, proc.stderr
    back = csv_files(tmp_path / "csv" / source.name)
    assert set(back) == set(original)
    for name, rows in original.items():
        assert back[name] == rows, name  # same header, rows, order and digits


def test_live_tensorboard_converts_to_the_live_csv_up_to_float32(write_config, output_dir, tmp_path):
    monitored_run(write_config, steps=2)
    source = rank_dir(output_dir)
    rows = tensorboard_to_csv(RankSource(0, str(source), source.name), str(tmp_path))
    assert rows > 0
    original, back = csv_files(source), csv_files(tmp_path / source.name)
    assert set(back) == set(original)
    for name, lines in original.items():
        assert [r[:3] for r in back[name]] == [r[:3] for r in lines], name
        for got, want in zip(back[name][1:], lines[1:]):
            assert [float(x) for x in got[-len(ALL_OPS) :]] == pytest.approx(
                [float(x) for x in want[-len(ALL_OPS) :]], rel=1e-6, abs=1e-7, nan_ok=True
            ), (name, got, want)


def test_msprobe_tag_layout_round_trips(write_config, output_dir, tmp_path):
    monitored_run(write_config, steps=2)
    source = rank_dir(output_dir)
    out = tmp_path / "tb"
    csv_to_tensorboard(
        RankSource(0, str(source), source.name), str(out), layout="msprobe", categories=["grad_reduced", "actv"]
    )
    assert sorted(p.name for p in (out / "rank0").iterdir()) == ["actv", "grad_reduced"]
    values = tb_values(out / "rank0" / "grad_reduced")
    assert ("vp0:fc1.weight/norm", 1) in values
    assert ("vp0:fc1.output:micro1/max", 0) in tb_values(out / "rank0" / "actv")
    back = tmp_path / "csv"
    for rank in find_ranks(str(out)):
        tensorboard_to_csv(rank, str(back), steps_per_file=2, ndigits=8)
    original, result = csv_files(source), csv_files(back / "rank0")
    assert set(result) == {"grad_reduced_0-1.csv", "actv_0-1.csv"}
    for name in result:
        assert result[name] == original[name], name


def test_csv2tb_msprobe_refuses_two_runs_of_a_rank_before_writing_anything(write_config, output_dir, tmp_path):
    monitored_run(write_config, steps=1)
    first = rank_dir(output_dir)
    second = output_dir / (first.name[:-8] + "0" * 8)
    shutil.copytree(first, second)  # a second run of rank 0 in the same folder
    out = tmp_path / "new_dir"
    proc = msmon_cli("csv2tb", "-d", str(output_dir), "--tags", "msprobe", "-o", str(out))
    assert proc.returncode == 1
    assert f"holds 2 directories of rank 0 ({second.name}, {first.name})" in proc.stderr  # in name order
    assert "--time-start/--time-end" in proc.stderr and "exists and is not empty" not in proc.stderr
    assert not out.exists()  # refused before writing anything
    proc = msmon_cli("csv2tb", "-d", str(first), "--tags", "msprobe", "-o", str(out))  # one run: converted
    assert proc.returncode == 0, proc.stderr
    assert ("vp0:fc1.weight/norm", 0) in tb_values(out / "rank0" / "grad_reduced")


def test_float32_simple_values_are_read_by_event_accumulator_scalars(write_config, output_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitored_run(write_config, steps=2)
    source = rank_dir(output_dir)
    csv_to_tensorboard(RankSource(0, str(source), source.name), str(tmp_path), float32=True)
    acc = EventAccumulator(str(tmp_path / source.name), size_guidance={"scalars": 0})
    acc.Reload()
    assert "0:fc2.bias/rank0/exp_avg_sq_norm" in acc.Tags()["scalars"]
    assert not acc.Tags()["tensors"]


def test_time_range_selects_rank_directories_converted_in_parallel_and_an_empty_selection_is_an_error(tmp_path):
    base = tmp_path / "monitor_output"
    for name in ("Dec01_10-00-00-rank0-aaaaaaaa", "Dec01_10-00-00-rank1-bbbbbbbb", "Dec02_10-00-00-rank0-cccccccc"):
        (base / name).mkdir(parents=True)
        (base / name / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,norm\n0,w,0,1.5\n")
    chosen = find_ranks(str(base), "Dec01_00-00-00", "Dec01_23-59-59")
    assert [(s.rank, s.name) for s in chosen] == [
        (0, "Dec01_10-00-00-rank0-aaaaaaaa"),
        (1, "Dec01_10-00-00-rank1-bbbbbbbb"),
    ]
    proc = msmon_cli(
        "csv2tb",
        "-d",
        str(base),
        "--time-start",
        "Dec01_00-00-00",
        "--time-end",
        "Dec01_23-59-59",
        "-o",
        str(tmp_path / "tb"),
        "-j",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [s.name for s in chosen]
    proc = msmon_cli("csv2tb", "-d", str(base), "--time-start", "Jan01_00-00-00", "--time-end", "Jan01_00-00-01")
    assert proc.returncode != 0 and "no rank directory" in proc.stderr
    proc = msmon_cli("csv2tb", "-d", str(base), "-o", str(tmp_path / "tb"))
    assert proc.returncode != 0 and "is not empty" in proc.stderr


def test_collective_rows_map_to_the_live_collective_tags_and_back():
    row = Row("other", "0", "all_reduce@train.py[23]/post", "")
    tag = msmon_tag(row, 1)
    assert tag == "all_reduce@train.py[23]/rank1/post"  # collectors/comm.py CollectiveKey.tag
    assert parse_msmon_tag(tag + "_norm") == (row, "norm")
    from msmon.collectors.comm import CollectiveKey

    assert CollectiveKey("other", row.name).tag(1) == tag
    assert parse_msmon_tag("0:layers.0.mlp/rank0/exp_avg_sq_mean") == (
        Row("exp_avg_sq", "0", "layers.0.mlp", ""),
        "mean",
    )
    assert parse_msmon_tag("1:fc.input:3/rank0/actv_nans") == (Row("actv", "1", "fc.input", "3"), "nans")
