"""The prepared GPU script (benchmarks/gpu/accelerator_table.py) runs its whole code on the CPU
in --dry-run mode, so it works the day a GPU is lent: every configuration measured, the sync
check run on each (and passing on the accelerator path), msprobe's absence said in the table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.e2e
def test_the_gpu_tables_dry_run_measures_every_configuration_and_finds_no_sync():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "accelerator_table.py"), "--dry-run", "--no-msprobe"]
    cmd.append("--both-routes")  # the compiled pass, and the _foreach_* route of a device without a compiler
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for config in ("wg", "wg+mv+param", "xy 10 of N"):
        cells = [cell.strip() for cell in rows[config].split("|")[1:-1]]
        assert cells[2].startswith("×") and cells[3] == "no sync" and cells[4] == "absent", cells
        assert cells[6].startswith("×") and cells[7] == "no sync", cells
    assert "MSMON_DEVICE_PATH=1" in proc.stdout and "bit-identical with and without msmon: yes" in proc.stdout


@pytest.mark.e2e
def test_the_cpu_sync_check_catches_the_host_reads_of_the_cpu_path():
    """The stand-in is not blind: on the CPU's own path msmon reads 0-d CPU witnesses, which the
    check reports (a GPU never sees them: that path is CPU-only)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_worker.py"), "--model", "gpt-tiny", "--config"]
    cmd += ["xy 10 of N", "--pairs", "2", "--warmup", "0", "--sync-check"]
    env = {"MSMON_NATIVE_STATS": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = json.loads(proc.stdout.splitlines()[-1])["sync_check"]["forward_backward"]
    # the read raised inside a hook: msmon contained it by switching the collector off
    assert not check["ok"] and check["collectors_switched_off"] == ["activations"]
