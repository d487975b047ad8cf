"""Under DDP, grad_unreduced is the rank-local accumulated gradient and grad_reduced the averaged one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, rank_dir, read_csv_rows, reference_stats
from test_core_metrics import assert_row_matches


@pytest.mark.e2e
def test_unreduced_is_rank_local_and_reduced_is_the_all_reduced_mean(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": "csv",
                                  "ops": ["norm", "min", "max", "mean", "zeros", "nans", "infs"]}))
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "tests" / "scripts" / "core_ddp_grads.py"), str(config), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        directory = rank_dir(out, rank)
        unreduced = read_csv_rows(directory, "grad_unreduced")
        reduced = read_csv_rows(directory, "grad_reduced")
        assert len(unreduced) == len(reduced) == 2 * 4
        for row in unreduced:
            assert_row_matches(row, reference_stats(truth[int(row["step"])]["local"][row["name"]]))
        for row in reduced:
            assert_row_matches(row, reference_stats(truth[int(row["step"])]["reduced"][row["name"]]))
    # the two ranks saw different data: their local gradients differ, the reduced ones agree
    r0 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 0), "grad_unreduced")}
    r1 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 1), "grad_unreduced")}
    assert r0 != r1
    g0 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 0), "grad_reduced")}
    g1 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 1), "grad_reduced")}
    assert g0 == g1
