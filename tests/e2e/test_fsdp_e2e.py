"""PyTorch FSDP under `msmon run`, for real: 2 CPU ranks on gloo (4 for HSDP), no monitoring code in the
script: FSDP2 (`fully_shard`, and HSDP: 4 ranks, 2 replica groups of 2 shards), FSDP1 with original
parameters and with flat parameters, on a model with uneven shards (and a parameter whose
piece on rank 1 is empty).

The truth is what torch itself assembles in the same run (`full_tensor()`,
`summon_full_params`, `optim_state_dict`; tests/scripts/fsdp_train.py), while msmon reads only
each rank's piece and combines statistics; rank-local gradients are checked against an
unwrapped copy of the model fed the same batches. One torchrun job per configuration, many
checks on its output.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ALL_OPS, ROOT, assert_agreement_rows_are, precision_slack, read_csv_rows

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "fsdp_train.py"
CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "mg_direction": True,
    "xy_distribution": True,
    "format": ["csv"],
    "ndigits": 12,
    "squash_name": False,
    "ops": ALL_OPS,
}
WHOLE = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
PARAMS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"}
MODULES = {"fc1", "act", "fc2"}
STEPS = 3
MODES = ("fsdp2", "hsdp", "fsdp1", "fsdp1-flat")
# accumulation without reducing but the step's last micro-batch (set_requires_gradient_sync, no_sync())
NO_SYNC = ("hsdp", "fsdp1-flat")
WORLD = {"hsdp": 4}  # 2 replica groups of 2 shards; the others run on 2 ranks


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def run(work: Path, mode: str, monitored: bool) -> subprocess.CompletedProcess:
    work.mkdir(parents=True, exist_ok=True)
    script = [str(SCRIPT), "--mode", mode, "--steps", str(STEPS), "--out", str(work)]
    script += ["--no-sync"] if mode in NO_SYNC else []
    ranks = str(WORLD.get(mode, 2))
    if monitored:
        (work / "monitor.json").write_text(json.dumps(CONFIG))
        launcher = ["-m", "msmon.launcher", "run", "--config", str(work / "monitor.json")]
        launcher += ["--output-dir", str(work / "out"), "--standalone", "--nproc-per-node", ranks, "--"]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks]
    proc = subprocess.run(
        [sys.executable, *launcher, *script], capture_output=True, text=True, timeout=300, env=env(), cwd=work
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def output_of(work: Path, rank: int) -> Path:
    dirs = glob.glob(str(work / "out" / f"*-rank{rank}-*"))
    assert len(dirs) == 1, dirs
    return Path(dirs[0])


def truth(work: Path, rank: int = 0) -> dict:
    return json.loads((work / f"truth_rank{rank}.json").read_text())


def assert_close(row: dict[str, str], expected: dict[str, float], what: str) -> None:
    """Float32 kernels on pieces against a float64 reference on the whole: relative 1e-5; a mean
    of values that cancel is judged against the values' magnitude, not the mean's (a std: conftest's
    precision_slack)."""
    for op, value in expected.items():
        got = float(row[op])
        if math.isnan(value):
            assert math.isnan(got), (what, op)
            continue
        slack = precision_slack(op, expected)
        assert got == pytest.approx(value, rel=1e-5, abs=1.5e-12 + slack), (what, op, got, value)


@pytest.fixture(scope="module", params=MODES)
def job(request, tmp_path_factory):
    mode = request.param
    work = tmp_path_factory.mktemp(mode)
    proc = run(work, mode, monitored=True)
    return mode, work, proc


def test_the_fsdp_adapter_is_chosen_from_the_parameters(job):
    mode, work, proc = job
    assert truth(work)["optimizer"] == "Adam"
    for rank in (0, 1):
        assert f"msmon[rank {rank}]: monitoring Adam of " in proc.stderr
    assert "failed" not in proc.stderr, proc.stderr[-3000:]


def test_every_category_equals_the_whole_tensor_torch_assembles(job):
    _, work, _ = job
    steps = truth(work)["steps"]
    directory = output_of(work, 0)
    for category in WHOLE:
        rows = read_csv_rows(directory, category)
        assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted(
            (s, n) for s in range(STEPS) for n in PARAMS
        ), category
        for row in rows:
            assert_close(row, steps[int(row["step"])][category][row["name"]], f"{category} {row['name']}")


def test_mg_direction_is_the_share_of_the_whole_gradient_and_momentum(job):
    _, work, _ = job
    steps = truth(work)["steps"]
    rows = read_csv_rows(output_of(work, 0), "other")
    assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted((s, n) for s in range(1, STEPS) for n in PARAMS)
    for row in rows:
        assert float(row["mean"]) == pytest.approx(steps[int(row["step"])]["mg_direction"][row["name"]], abs=1e-12)


def test_whole_tensors_are_written_once_by_the_first_rank(job):
    mode, work, _ = job
    for rank in range(1, WORLD.get(mode, 2)):  # HSDP: neither the other shard nor the other replica group
        directory = output_of(work, rank)
        for category in (*WHOLE, "other"):
            assert not read_csv_rows(directory, category), (rank, category)
        assert read_csv_rows(directory, "grad_unreduced"), rank


def test_rank_local_gradients_are_those_before_the_reduce_scatter(job):
    """Without no_sync FSDP reduce-scatters every micro-batch: the last one's gradient is reported;
    with it, the gradient accumulated over the step's micro-batches."""
    mode, work, _ = job
    local = "local_acc" if mode in NO_SYNC else "local_last"
    norms = {}
    for rank in (0, 1):
        steps = truth(work, rank)["steps"]
        rows = read_csv_rows(output_of(work, rank), "grad_unreduced")
        assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted((s, n) for s in range(STEPS) for n in PARAMS)
        for row in rows:
            assert_close(row, steps[int(row["step"])][local][row["name"]], f"rank {rank} {row['name']}")
        norms[rank] = {(r["step"], r["name"]): r["norm"] for r in rows}
    assert norms[0] != norms[1]  # different batches on the two ranks


def test_activations_keep_the_users_module_names(job):
    _, work, _ = job
    for rank in (0, 1):
        names = {r["name"] for r in read_csv_rows(output_of(work, rank), "actv")}
        assert {n.rsplit(".", 1)[0] for n in names} == MODULES, names
        assert not any("_fsdp" in n or "module" in n for n in names)


def test_losses_are_bit_identical_with_and_without_monitoring(job, tmp_path):
    mode, work, _ = job
    plain = tmp_path / "plain"
    run(plain, mode, monitored=False)
    for rank in (0, 1):
        assert truth(work, rank)["losses"] == truth(plain, rank)["losses"]


def run_script(work: Path, script: str, *extra: str) -> subprocess.CompletedProcess:
    """`msmon run` of another unmodified FSDP script on 2 ranks (its truth in `work`)."""
    work.mkdir()
    (work / "monitor.json").write_text(json.dumps(dict(CONFIG, xy_distribution=False)))
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(work / "monitor.json")]
    argv += ["--output-dir", str(work / "out"), "--standalone", "--nproc-per-node", "2", "--"]
    argv += [str(ROOT / "tests" / "scripts" / script), "--out", str(work), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env(), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_whole_weights_written_once(work: Path) -> None:
    """The recorded param_updated rows of every step equal the script's full_tensor() statistics."""
    recorded = {}
    for rank in (0, 1):
        dirs = [
            Path(d)
            for d in glob.glob(str(work / "out" / f"*-rank{rank}-*"))
            if json.loads((Path(d) / "summary.json").read_text())["steps_recorded"] > 0
        ]
        assert len(dirs) == 1, dirs
        recorded[rank] = dirs[0]
    steps = json.loads((work / "truth_rank0.json").read_text())["param_updated"]
    rows = read_csv_rows(recorded[0], "param_updated")
    assert sorted((int(r["step"]), r["name"]) for r in rows) == sorted((s, n) for s in range(3) for n in steps[0])
    for row in rows:
        assert_close(row, steps[int(row["step"])][row["name"]], row["name"])
    assert not read_csv_rows(recorded[1], "param_updated")
    assert read_csv_rows(recorded[1], "grad_unreduced")


def test_accelerate_prepare_moving_the_optimizer_onto_fsdp2_parameters_is_followed(tmp_path):
    """accelerate builds nothing itself: the optimizer the script built over the plain model is
    pointed at the sharded parameters by `prepare`; its monitor is released there and a new one
    records the FSDP2 weights (on CPU the script switches accelerate's state to FSDP itself)."""
    proc = run_script(tmp_path / "accelerate", "fsdp_accelerate.py")
    for rank in (0, 1):
        assert f"msmon[rank {rank}]: monitoring Adam of FSDPSequential (attached at accelerate prepare (FSDP))" in (
            proc.stderr
        )
    assert_whole_weights_written_once(tmp_path / "accelerate")


def test_lightning_model_parallel_strategy_with_fully_shard_is_monitored_without_code(tmp_path):
    proc = run_script(tmp_path / "lightning", "fsdp_lightning.py")
    for rank in (0, 1):
        assert f"msmon[rank {rank}]: monitoring Adam of Model (attached at construction)" in proc.stderr
    assert_whole_weights_written_once(tmp_path / "lightning")


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reducing-every-micro-batch"])
def test_no_shard_records_the_scripts_own_grad_agreement_when_it_reduces_once_per_step(tmp_path, no_sync):
    """FSDP1 NO_SHARD all-reduces the whole flat gradient: with `no_sync()` on all but the last
    micro-batch the agreement rows are the script's own cos and norm ratio (its unwrapped copy's
    summed gradients against their mean over the ranks). Reducing every micro-batch, the second
    reduction starts from a reduced sum: the rank-local gradient is gone, and one line says so."""
    work = tmp_path / "noshard"
    work.mkdir()
    config = {"wg_distribution": True, "grad_agreement": True, "format": ["csv"], "ndigits": 12}
    (work / "monitor.json").write_text(json.dumps(config))
    script = [str(SCRIPT), "--mode", "fsdp1-noshard", "--steps", str(STEPS), "--out", str(work)]
    script += ["--no-sync"] if no_sync else []
    launcher = ["-m", "msmon.launcher", "run", "--config", str(work / "monitor.json")]
    launcher += ["--output-dir", str(work / "out"), "--standalone", "--nproc-per-node", "2", "--"]
    proc = subprocess.run(
        [sys.executable, *launcher, *script], capture_output=True, text=True, timeout=300, env=env(), cwd=work
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "grad_agreement is not recorded" not in proc.stderr
    for rank in (0, 1):
        rows = read_csv_rows(output_of(work, rank), "grad_agreement")
        if not no_sync:
            assert rows == []
            assert proc.stderr.count(f"msmon[rank {rank}]: step 0 reduced a gradient more than once") == 1
            continue
        expected = truth(work, rank)["agreement"]
        assert len(expected) == STEPS
        assert_agreement_rows_are(rows, expected)
        assert all(c < 1 for c, _ in expected)
    if no_sync:  # monitoring changed nothing: the same job unmonitored has bit-identical losses
        plain = tmp_path / "plain"
        plain.mkdir()
        script = [str(SCRIPT), "--mode", "fsdp1-noshard", "--steps", str(STEPS), "--out", str(plain), "--no-sync"]
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        proc = subprocess.run(
            [sys.executable, *launcher, *script], capture_output=True, text=True, timeout=300, env=env(), cwd=plain
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rank in (0, 1):
            assert truth(plain, rank)["losses"] == truth(work, rank)["losses"]
