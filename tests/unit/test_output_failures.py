"""A disk that fills up mid-run: one line per rank naming the cause, output off, training on,
the cause in summary.json (when the disk still takes it) and in the launcher's end-of-job
lines. The failures are real: writes to /dev/full, or a tmpfs a few kilobytes large."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import MLP, ROOT, rank_dir, read_csv_rows
from msmon import TrainerMon

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")

SCRIPTS = ROOT / "tests" / "scripts"
MSMON = [sys.executable, "-m", "msmon.launcher"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TWO_RANKS = ["--standalone", "--nproc-per-node", "2"]
CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "format": ["csv", "tensorboard"],
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def losses(stdout: str) -> list[str]:
    """Every rank's loss lines (found anywhere: two ranks' unbuffered prints can share a line)."""
    return sorted(re.findall(r"rank \d step \d+ loss [\d.]+", stdout))


def train(model, optimizer, steps: int, full_at: int | None = None, log_dir: str | None = None) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        if step == full_at:
            os.symlink("/dev/full", os.path.join(log_dir, f"grad_reduced_{step}-{step}.csv"))
        loss = model(torch.randn(5, 8, generator=gen)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def test_a_full_disk_stops_the_api_monitors_output_with_one_line_and_training_goes_on(
    write_config, output_dir, caplog, capfd
):
    torch.manual_seed(0)
    reference = MLP()
    expected = train(reference, torch.optim.Adam(reference.parameters(), lr=0.01), 4)

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    monitor = TrainerMon(write_config(CONFIG))
    monitor.set_monitor(model, optimizer, grad_acc_steps=1)
    with caplog.at_level(logging.INFO, logger="msmon"):
        got = train(model, optimizer, 4, full_at=2, log_dir=monitor.log_dir)
        reduced, _ = monitor.generate_wgrad_metrics()  # the in-memory API still has the last step
        monitor.close()
    assert got == expected  # bit-identical losses: training went on, untouched

    full = os.path.join(monitor.log_dir, "grad_reduced_2-2.csv")
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == [
        f"msmon[rank 0]: output stopped at step 2: No space left on device (ENOSPC) writing {full}; "
        "nothing more is written to disk, training continues"
    ]
    assert "Traceback" not in capfd.readouterr().err  # no thread died with a traceback
    assert reduced["0:fc1.weight/rank0/grad_reduced"]["norm"] > 0  # step 3 reached the API
    out = rank_dir(output_dir)
    os.remove(full)  # the link to /dev/full, which reads zeros without end
    assert {r["step"] for r in read_csv_rows(out, "grad_reduced")} == {"0", "1"}
    assert glob.glob(str(out / "*_1-1.csv")) and not glob.glob(str(out / "*_3-3.csv"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["output_stopped"] == {"step": 2, "errno": "ENOSPC", "error": "No space left on device", "path": full}
    assert summary["steps_recorded"] == 4


def test_a_full_disk_on_one_rank_of_msmon_run_is_one_line_there_and_in_the_end_of_job_summary(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps(CONFIG))
    plain = subprocess.run(
        [*TORCHRUN, *TWO_RANKS, str(SCRIPTS / "output_disk_full.py"), "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *MSMON,
            "run",
            "--config",
            str(config),
            "--output-dir",
            str(out),
            *TWO_RANKS,
            "--",
            str(SCRIPTS / "output_disk_full.py"),
            "--steps",
            "5",
            "--full-rank",
            "1",
            "--full-at",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert losses(proc.stdout) == losses(plain.stdout) and len(losses(plain.stdout)) == 10

    directory = rank_dir(out, 1)
    shown = os.path.relpath(directory, tmp_path)
    worker = [
        line for line in proc.stderr.splitlines() if line.startswith("msmon[rank 1]") and "monitoring" not in line
    ]
    assert worker == [
        f"msmon[rank 1]: output stopped at step 2: No space left on device (ENOSPC) writing "
        f"{directory}/grad_reduced_2-2.csv; nothing more is written to disk, training continues"
    ]
    assert (
        f"msmon: rank 1: output stopped at step 2: No space left on device (ENOSPC) writing "
        f"{shown}/grad_reduced_2-2.csv; what was recorded before step 2 is in {shown}"
    ) in proc.stderr
    assert re.search(r"^msmon: rank 0: 5 steps recorded, 0 alerts raised", proc.stderr, re.M), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert json.loads((directory / "summary.json").read_text())["output_stopped"]["errno"] == "ENOSPC"
    os.remove(directory / "grad_reduced_2-2.csv")  # the link to /dev/full, which reads zeros without end
    assert {r["step"] for r in read_csv_rows(directory, "grad_reduced")} == {"0", "1"}
    assert not glob.glob(str(directory / "*_3-3.csv"))


def _tiny_filesystems() -> bool:
    """Whether this user may mount a tmpfs of its own (an unprivileged user namespace)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            "d=$(mktemp -d) && mount -t tmpfs -o size=16k tmpfs $d && umount $d && rmdir $d",
        ],
        capture_output=True,
        timeout=60,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _tiny_filesystems(), reason="cannot mount a tmpfs in a user namespace here")
def test_a_disk_that_fills_up_under_msmon_run_says_why_even_when_summary_json_cannot_be_written(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps(CONFIG))
    disk = tmp_path / "disk"
    disk.mkdir()
    job = " ".join(
        [
            *MSMON,
            "run",
            "--config",
            str(config),
            "--output-dir",
            str(disk / "out"),
            *TWO_RANKS,
            "--",
            str(SCRIPTS / "output_disk_full.py"),
            "--steps",
            "30",
        ]
    )
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=96k tmpfs {disk} && {job}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(losses(proc.stdout)) == 60  # every step of both ranks ran
    assert "Traceback" not in proc.stderr and "could not write" not in proc.stderr
    for rank in (0, 1):
        worker = [
            line
            for line in proc.stderr.splitlines()
            if line.startswith(f"msmon[rank {rank}]") and "monitoring" not in line and "non-finite origin" not in line
        ]
        assert len(worker) == 1, proc.stderr[-4000:]
        assert re.fullmatch(
            rf"msmon\[rank {rank}\]: output stopped at step \d+: No space left on device \(ENOSPC\) "
            r"writing \S+; nothing more is written to disk, training continues",
            worker[0],
        )
        assert re.search(
            rf"^msmon: rank {rank}: output stopped at step \d+: No space left on device \(ENOSPC\) "
            r"writing \S+; ",
            proc.stderr,
            re.M,
        ), proc.stderr[-3000:]
