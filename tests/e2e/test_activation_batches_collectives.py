"""On the accelerator path under torch.distributed, a collective that writes into a noted
activation (or its gradient) in place is not misreported: the batch is read before it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ALL_OPS, ROOT, assert_row_matches, rank_dir, read_csv_rows, reference_stats


@pytest.mark.e2e
def test_rows_are_of_the_values_the_hooks_saw_before_the_scripts_in_place_collectives(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"xy_distribution": True, "all_xy": True, "format": "csv", "ops": ALL_OPS}))
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1", MSMON_DEVICE_PATH="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    cmd += [str(ROOT / "tests" / "scripts" / "actv_collective_inplace.py"), str(config), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "changed in place" not in proc.stderr
    assert "compiled statistics pass is off" not in proc.stderr  # the accelerator path's compiled kernel ran
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        for category, expected in truth.items():
            rows = {(r["step"], r["name"]): r for r in read_csv_rows(rank_dir(out, rank), category)}
            for step in ("0", "1"):
                for name, tensor in expected.items():
                    assert_row_matches(rows[(step, name)], reference_stats(tensor))
    # the ranks' own values differ (they saw different data): the rows are rank-local
    local = [
        {r["name"]: r["norm"] for r in read_csv_rows(rank_dir(out, rank), "actv") if r["step"] == "0"}
        for rank in (0, 1)
    ]
    assert local[0]["fc1.output"] != local[1]["fc1.output"]
