"""Acceptance: unmodified scripts under `msmon run` (real torchrun, 2 processes on gloo) give,
rank by rank, the same output as the TrainerMon API gives for the same script."""

from __future__ import annotations

import csv
import filecmp
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

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
    "format": ["csv"],
    "ops": ["norm", "min", "max", "mean", "zeros", "nans", "infs"],
}


def clean_env(**extra: str) -> dict[str, str]:
    """One thread per process everywhere (torchrun sets it only for several processes per
    node): matmuls then add in the same order in every layout, so outputs compare exactly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 300):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or clean_env())


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("config") / "monitor.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def msmon_run(config: str, out: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    proc = run([*MSMON, "run", "--config", config, "--output-dir", str(out), *args], env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def api_run(config: str, out: Path, script: str, *args: str):
    """The same script attaching with the TrainerMon API itself (`--api`), under plain torchrun."""
    proc = run(
        [*TORCHRUN, *TWO_RANKS, str(SCRIPTS / script), *args, "--api", config],
        env=clean_env(MONITOR_OUTPUT_DIR=str(out)),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def rank_dir(out: Path, rank: int) -> Path:
    (directory,) = glob.glob(str(out / f"*-rank{rank}-*"))
    return Path(directory)


def assert_same_output(auto: Path, api: Path, ranks=(0, 1)) -> None:
    for rank in ranks:
        a, b = rank_dir(auto, rank), rank_dir(api, rank)
        files = sorted(p.name for p in a.iterdir() if p.suffix == ".csv")
        assert len(files) >= 6, files  # every category, every step
        assert files == sorted(p.name for p in b.iterdir() if p.suffix == ".csv")
        match, mismatch, errors = filecmp.cmpfiles(a, b, files + ["config.json"], shallow=False)
        assert (mismatch, errors) == ([], []), f"rank {rank}: {mismatch} {errors}"


def assert_summary(proc, steps: int, ranks=(0, 1)) -> None:
    for rank in ranks:
        line = (
            rf"^msmon: rank {rank}: {steps} steps recorded, 0 alerts raised, monitor cost [\d.]+ % of step time .* -> "
        )
        assert re.search(line, proc.stderr, re.M), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_api_output(config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_api")
    api_run(config, out, "launcher_ddp.py")
    return out


def test_plain_ddp_script_matches_the_api(config, ddp_api_output, tmp_path):
    proc = msmon_run(config, tmp_path, *TWO_RANKS, "--", str(SCRIPTS / "launcher_ddp.py"))
    assert_summary(proc, 3)
    assert_same_output(tmp_path, ddp_api_output)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_with_c10d_rendezvous_match_the_api(config, ddp_api_output, tmp_path):
    rendezvous = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        uuid.uuid4().hex[:8],
    ]
    nodes = [
        subprocess.Popen(
            [
                *MSMON,
                "run",
                "--config",
                config,
                "--output-dir",
                str(tmp_path),
                *rendezvous,
                "--node-rank",
                str(node),
                "--",
                str(SCRIPTS / "launcher_ddp.py"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    summaries = [line for _, err in outputs for line in err.splitlines() if line.startswith("msmon: rank")]
    assert len(summaries) == 2  # each node's launcher reports its own worker
    assert_same_output(tmp_path, ddp_api_output)


@pytest.mark.parametrize(
    "script, args, attached",
    [
        ("launcher_hf_trainer.py", ["--output", "{tmp}/hf"], "AdamW of GPT2LMHeadModel"),  # transformers.Trainer
        ("launcher_accelerate.py", [], "AdamW of Sequential"),  # built before accelerator.prepare
        ("launcher_lightning.py", [], "Adam of DistributedDataParallel"),  # Trainer(strategy="ddp")
    ],
    ids=["hf_trainer", "accelerate", "lightning"],
)
def test_framework_scripts_match_the_api(config, tmp_path, script, args, attached):
    args = [a.format(tmp=tmp_path) for a in args]
    auto, api = tmp_path / "auto", tmp_path / "api"
    proc = msmon_run(config, auto, *TWO_RANKS, "--", str(SCRIPTS / script), *args)
    assert f"monitoring {attached} (attached at construction)" in proc.stderr
    assert_summary(proc, 3)
    api_run(config, api, script, *args)
    assert_same_output(auto, api)


@pytest.fixture(scope="module")
def loader_job(config, tmp_path_factory):
    """`-m launcher_pkg.train_loader` with a user sitecustomize on PYTHONPATH and spawned
    DataLoader workers; the bootstrap directory is kept to see which processes activated."""
    base = tmp_path_factory.mktemp("loader")
    pids = base / "pids"
    pids.mkdir()
    env = clean_env(
        PYTHONPATH=str(SCRIPTS / "launcher_user_site"), LAUNCHER_TEST_PIDS=str(pids), MSMON_KEEP_BOOTSTRAP="1"
    )
    proc = msmon_run(config, base / "out", *TWO_RANKS, "--", "-m", "launcher_pkg.train_loader", env=env, cwd=SCRIPTS)
    kept = re.search(r"bootstrap directory kept: (\S+)", proc.stderr).group(1)
    records = [json.loads(Path(p).read_text()) for p in glob.glob(os.path.join(kept, "workers", "*.json"))]
    shutil.rmtree(kept)
    files = {p.name for p in pids.iterdir()}
    return {
        "proc": proc,
        "records": records,
        "loader_pids": {int(n.split("-")[-1]) for n in files if n.startswith("loader-")},
        "user_site_pids": {int(n.split("-")[-1]) for n in files if n.startswith("user-site-")},
    }


def test_a_module_target_runs_and_is_monitored(loader_job):
    proc = loader_job["proc"]
    assert "rank 0 trained 3 steps" in proc.stdout and "rank 1 trained 3 steps" in proc.stdout
    assert_summary(proc, 3)


def test_dataloader_workers_do_not_activate(loader_job):
    records = loader_job["records"]
    assert sorted(r["rank"] for r in records) == [0, 1]  # only the two training workers
    assert len(loader_job["loader_pids"]) == 4  # two spawned DataLoader workers per rank really ran
    assert not loader_job["loader_pids"] & {r["pid"] for r in records}


def test_a_user_sitecustomize_still_runs_in_every_process(loader_job):
    workers = {r["pid"] for r in loader_job["records"]}
    assert workers | loader_job["loader_pids"] <= loader_job["user_site_pids"]
    assert len(loader_job["user_site_pids"]) >= 7  # and in torchrun's agent too


def test_a_crash_keeps_the_traceback_and_the_exit_code_of_plain_torchrun(config, tmp_path):
    script = [str(SCRIPTS / "launcher_single.py"), "--crash-at", "1"]
    monitored = run([*MSMON, "run", "--config", config, "--output-dir", str(tmp_path), *TWO_RANKS, "--", *script])
    plain = run([*TORCHRUN, *TWO_RANKS, *script])
    assert plain.returncode != 0
    assert monitored.returncode == plain.returncode
    for proc in (monitored, plain):
        assert "Traceback (most recent call last)" in proc.stderr and "ValueError: crash at step 1" in proc.stderr
    # torchrun stops the other rank as soon as one fails, so only a rank that reached the crash
    # is sure to have recorded step 0; no rank may report anything else
    line = r"^msmon: rank \d: 1 steps recorded, 0 alerts raised(, monitor cost .*)? -> "
    assert re.search(line, monitored.stderr, re.M), monitored.stderr[-3000:]
    for line in re.findall(r"^msmon: rank \d: .*$", monitored.stderr, re.M):
        assert re.search(r"[01] steps recorded|nothing was monitored", line), line


def test_struct_prints_the_module_tree_and_stops_at_the_first_step(tmp_path):
    proc = run(
        [
            *MSMON,
            "struct",
            "--output-dir",
            str(tmp_path),
            *TWO_RANKS,
            "--",
            str(SCRIPTS / "launcher_ddp.py"),
            "--steps",
            "5",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 0 loss" not in proc.stdout  # stopped inside the first optimizer step
    # rank 0 printed the tree, each module by the dotted name `targets` takes
    assert re.search(r"^\s*layers\.0\.attn\.qkv  \[input tensor: size=\(4, 8, 16\)", proc.stdout, re.M)
    for rank in (0, 1):
        struct = json.loads((tmp_path / "module_struct" / f"rank{rank}" / "module_struct.json").read_text())
        assert struct["layers.0.attn.qkv"]["input"]["0"] == "size=(4, 8, 16), dtype=torch.float32"
        assert f"msmon: rank {rank}: module structure written to" in proc.stderr
    # the ranks' scratch output is the launcher's business, and print_struct is not the user's setting
    assert "msmon-struct_output" not in proc.stdout + proc.stderr
    assert "print_struct" not in proc.stdout + proc.stderr
    assert "msmon[rank 0]: reading the module structure of DistributedDataParallel" in proc.stderr


def test_accelerates_own_test_script_gets_one_monitor_per_optimizer(tmp_path):
    """A real third-party script that builds about ten optimizers in sequence (single process:
    its multi-process mode fails under plain torchrun on CPU as well)."""
    import accelerate

    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_script.py"
    out = tmp_path / "out"
    proc = run([*MSMON, "run", "--output-dir", str(out), "--no-torchrun", "--", str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]  # and its own checks of the training results passed
    lines = [line for line in proc.stderr.splitlines() if line.startswith("msmon: rank 0")]
    assert len(lines) >= 5 and all(re.search(r": [1-9]\d* steps recorded", line) for line in lines), lines
    directories = [line.rsplit(" -> ", 1)[1] for line in lines]
    assert len(set(directories)) == len(lines) == len(glob.glob(str(out / "*-rank0-*")))  # no collision


@pytest.mark.parametrize(
    "optimizer, line, note",
    [
        (
            "none",
            "nothing was monitored (no torch.optim optimizer was created)",
            "no torch.optim optimizer was created",
        ),
        ("unstepped", "0 steps recorded (no optimizer step ran), 0 alerts raised", "no optimizer step ran"),
        (
            "loose",
            "nothing was monitored (SGD was built but never stepped; its parameters belonged to no module when "
            "it was built, so msmon waited for its first step)",
            "SGD was built but never stepped; its parameters belonged to no module when it was built, so msmon waited for "  # noqa: E501
            "its first step",
        ),
    ],
)
def test_a_job_with_no_optimizer_step_still_writes_each_ranks_summary_saying_why(
    config, tmp_path, optimizer, line, note
):
    proc = msmon_run(
        config,
        tmp_path / "out",
        *TWO_RANKS,
        "--",
        str(SCRIPTS / "launcher_no_step.py"),
        "--optimizer",
        optimizer,
        cwd=tmp_path,
    )
    assert proc.stdout.count(" output ") == 2
    for rank in (0, 1):
        directory = rank_dir(tmp_path / "out", rank)
        assert (directory / "config.json").is_file()
        summary = json.loads((directory / "summary.json").read_text())
        assert summary["steps_recorded"] == 0 and summary["note"] == note and summary["rank"] == rank
        assert f"msmon: rank {rank}: {line} -> out/{directory.name}" in proc.stderr, proc.stderr[-3000:]
    assert "no summary.json" not in proc.stderr


def test_a_script_importing_msmons_api_before_torch_is_monitored(config, tmp_path):
    """msmon.api imports torch; torch's post-import hook then switched the torch.optim
    instrumentor on while msmon.api was half imported, and it failed (nothing recorded)."""
    proc = msmon_run(config, tmp_path, "--nproc-per-node", "1", "--", str(SCRIPTS / "launcher_imports_msmon_first.py"))
    assert "failed to switch on" not in proc.stderr, proc.stderr[-3000:]
    assert_summary(proc, 3, ranks=(0,))
    assert list(rank_dir(tmp_path, 0).glob("grad_reduced_*.csv"))


@pytest.mark.parametrize(
    "when, said",
    [([], " (1 automatic monitor closed)\n"), (["--api-first"], "\n")],
    ids=["after_the_optimizer", "before_the_optimizer"],
)
def test_a_script_with_its_own_trainermon_is_monitored_once_by_it(config, tmp_path, when, said):
    """The script builds a TrainerMon after its optimizer, to which msmon run had already
    attached, or before it (msprobe's examples): the explicit monitor wins and the automatic
    one stands down, leaving no second directory (it had recorded nothing) and no double work."""
    out = tmp_path / "out"
    script = [str(SCRIPTS / "launcher_ddp.py"), "--api", config, *when]
    proc = msmon_run(config, out, "--nproc-per-node", "1", "--", *script)
    directories = glob.glob(str(out / "*-rank0-*"))
    assert len(directories) == 1, directories  # was two: the automatic monitor's and the script's
    assert "msmon's automatic monitoring stands down" + said in proc.stderr, proc.stderr[-3000:]
    directory = directories[0]
    summary = json.loads((Path(directory) / "summary.json").read_text())
    assert summary["steps_recorded"] == 3
    assert [r["step"] for r in read_rows(Path(directory), "grad_reduced", "qkv")] == ["0", "1", "2"]  # once each
    lines = re.findall(r"^msmon: rank 0: .*$", proc.stderr, re.M)
    assert (
        lines == [lines[0]]
        and lines[0].startswith("msmon: rank 0: 3 steps recorded")
        and lines[0].endswith(Path(directory).name)
    )


def read_rows(directory: Path, category: str, name_part: str) -> list[dict[str, str]]:
    rows = []
    for path in sorted(directory.glob(f"{category}_[0-9]*.csv")):
        rows += [r for r in csv.DictReader(path.open()) if name_part in r["name"] and r["name"].endswith("weight")][:1]
    return rows
