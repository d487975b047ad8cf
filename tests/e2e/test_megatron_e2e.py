"""Megatron-core's optimizers on 2 CPU ranks (real torchrun, gloo), monitored with the TrainerMon
API: the real optimizer classes of megatron-core 0.16.1 with their own step code, on a stand-in
for Megatron's DDP (see tests/scripts/megatron_cpu.py for what is real and what mirrors Megatron).

The truth is saved by the script in the same run: whole fp32 weights and Adam moments (shards
gathered), `main_grad` before and after the data-parallel grad sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_deepspeed_e2e import (
    assert_close,
    assert_grad_agreement_said_once_and_not_recorded,
    assert_loss_rows_are_the_scripts_losses,
)

from conftest import ALL_OPS, ROOT, assert_agreement_rows_are, rank_dir, read_csv_rows

pytestmark = pytest.mark.e2e

CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "loss_distribution": True,
    "grad_agreement": True,
    "format": ["csv"],
    "ndigits": 12,
    "ops": ALL_OPS,
}
WRITTEN_ONCE = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq")
CATEGORIES = WRITTEN_ONCE + ("grad_unreduced",)
CASES = ("fp32", "float16", "distributed", "chained", "tp")


def run_megatron_cpu(work: Path, config: dict, case: str, *extra: str) -> subprocess.CompletedProcess:
    """tests/scripts/megatron_cpu.py on 2 ranks under real torchrun; its truth goes to `work`."""
    path = work / "monitor.json"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(MONITOR_OUTPUT_DIR=str(work / "out"), OMP_NUM_THREADS="1")
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "scripts" / "megatron_cpu.py"),
        "--case",
        case,
        "--config",
        str(path),
        "--out",
        str(work),
        *extra,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module", params=CASES)
def megatron_job(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(request.param)
    proc = run_megatron_cpu(work, CONFIG, request.param)
    return request.param, work, proc


def recorded(work: Path, rank: int, category: str) -> dict[str, list[dict]]:
    """'{vpp}:{name}' -> its rows."""
    out: dict[str, list[dict]] = {}
    for row in read_csv_rows(rank_dir(work / "out", rank), category):
        out.setdefault(f"{row['vpp_stage']}:{row['name']}", []).append(row)
    return out


def test_loss_rows_are_each_ranks_micro_step_losses_and_grad_agreement_where_a_rank_holds_it(megatron_job):
    """Without the distributed optimizer the bucket groups all-reduce `main_grad`: the agreement
    rows are the script's own cos and norm ratio of `main_grad` before and after its grad sync.
    With it (distributed, chained) a rank holds only its shard, and one line per rank says so."""
    case, work, proc = megatron_job
    directories = {rank: rank_dir(work / "out", rank) for rank in (0, 1)}
    for rank, directory in directories.items():
        losses = json.loads((work / f"truth_rank{rank}.json").read_text())["losses"]
        assert_loss_rows_are_the_scripts_losses(directory, losses, micro=2)
    if case in ("distributed", "chained"):
        assert_grad_agreement_said_once_and_not_recorded(proc.stderr, directories, "Megatron")
        return
    assert "grad_agreement is not recorded" not in proc.stderr
    for rank, directory in directories.items():
        expected = [s["agreement"] for s in json.loads((work / f"truth_rank{rank}.json").read_text())["steps"]]
        assert_agreement_rows_are(read_csv_rows(directory, "grad_agreement"), expected)


def test_every_statistic_equals_the_whole_tensors_megatron_holds(megatron_job):
    case, work, _ = megatron_job
    steps = json.loads((work / "truth_rank0.json").read_text())["steps"]
    names = set(steps[0]["param_updated"])
    assert len(names) == (8 if case in ("distributed", "chained") else 4)  # two virtual-pipeline chunks: 0:, 1:
    for category in CATEGORIES:
        rows = recorded(work, 0, category)
        assert set(rows) == names, category
        for name, name_rows in rows.items():
            assert sorted(int(r["step"]) for r in name_rows) == [0, 1, 2]
            for row in name_rows:
                assert_close(row, steps[int(row["step"])][category][name], f"{category} {name}")


def test_replicated_tensors_are_written_once_and_rank_local_gradients_by_every_rank(megatron_job):
    case, work, _ = megatron_job
    truth1 = json.loads((work / "truth_rank1.json").read_text())["steps"]
    for category in WRITTEN_ONCE:
        rows = recorded(work, 1, category)
        if case == "tp":  # data parallelism 1, tensor parallelism 2: rank 1 writes its own split weight only
            assert set(rows) == {"0:fc1.weight"}, category
            for row in rows["0:fc1.weight"]:
                assert_close(row, truth1[int(row["step"])][category]["0:fc1.weight"], category)
        else:
            assert rows == {}, category
    local = recorded(work, 1, "grad_unreduced")
    assert set(local) == set(truth1[0]["grad_unreduced"])
    for name, rows in local.items():
        for row in rows:
            assert_close(row, truth1[int(row["step"])]["grad_unreduced"][name], name)
