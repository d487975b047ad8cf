"""The bootstrap: role detection, the sitecustomize chain, the job command line. Real Python
processes started with the job's environment; none of them imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from msmon.launcher import run_summary
from msmon.launcher.bootstrap import boot, job_directory
from msmon.launcher.job_command_line import UsageError, parse, sitecustomize_disabled_by

PROBE = textwrap.dedent("""
    import json, os, sys
    sitecustomize = sys.modules.get("sitecustomize")  # what site.py imported at start-up
    print(json.dumps({
        "pid": os.getpid(),
        "mark": os.environ.get("MSMON_ACTIVE_PID"),
        "torch_imported": "torch" in sys.modules,
        "sitecustomize": getattr(sitecustomize, "__file__", None),
        "hooked": any(type(f).__name__ == "ImportHookFinder" for f in sys.meta_path),
    }))
""")


@pytest.fixture
def job(tmp_path):
    """A bootstrap directory as `msmon run` writes it, and a user sitecustomize beside it."""
    directories = []

    def make(launcher="torchrun"):
        directory = job_directory.create({"wg_distribution": True}, None, launcher, "run", str(tmp_path / "out"))
        directories.append(directory)
        return directory

    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import os
        with open(os.environ["USER_SITE_LOG"], "a") as fh:
            fh.write(f"{os.getpid()}\\n")
    """)
    )
    yield make, user_site
    for directory in directories:
        job_directory.remove(directory)


def probe(env, *extra_args):
    proc = subprocess.run(
        [sys.executable, *extra_args, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def job_env(directory, user_site, tmp_path, **extra):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_"))}
    base["PYTHONPATH"] = str(user_site)
    env = job_directory.job_environment(base, directory, None)
    env["USER_SITE_LOG"] = str(tmp_path / "user_site.log")
    env.update(extra)
    return env


def user_site_runs(tmp_path):
    log = tmp_path / "user_site.log"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def test_roles_come_from_the_environment_alone():
    assert boot.decide_role({}, 10, "python") == boot.WORKER
    assert boot.decide_role({}, 10, "torchrun") == boot.AGENT
    assert boot.decide_role({"TORCHELASTIC_RUN_ID": "x"}, 10, "torchrun") == boot.WORKER
    assert boot.decide_role({"TORCHELASTIC_RUN_ID": "x", "MSMON_ACTIVE_PID": "9"}, 10, "torchrun") == boot.CHILD
    assert boot.decide_role({"MSMON_ACTIVE_PID": "9"}, 10, None) == boot.CHILD
    assert boot.decide_role({"MSMON_ACTIVE_PID": "10"}, 10, "python") == boot.ACTIVE
    env = {}
    boot.mark_active(env, 42)
    assert boot.decide_role(env, 43, None) == boot.CHILD


def test_a_torchrun_worker_activates_without_importing_torch_and_chains_the_user_sitecustomize(job, tmp_path):
    make, user_site = job
    seen = probe(job_env(make(), user_site, tmp_path, TORCHELASTIC_RUN_ID="run1"))
    assert seen["mark"] == str(seen["pid"])  # active, and marked for its children
    assert seen["hooked"] and not seen["torch_imported"]  # waits for torch, never imports it
    assert seen["sitecustomize"] == str(user_site / "sitecustomize.py")  # the user's, once imported
    assert user_site_runs(tmp_path) == [seen["pid"]]  # ran, exactly once


def test_the_torchrun_agent_and_a_workers_children_stay_inactive(job, tmp_path):
    make, user_site = job
    directory = make()
    agent = probe(job_env(directory, user_site, tmp_path))  # no TORCHELASTIC_RUN_ID: torchrun's agent
    assert agent["mark"] is None and not agent["hooked"]
    child = probe(job_env(directory, user_site, tmp_path, TORCHELASTIC_RUN_ID="run1", MSMON_ACTIVE_PID="1"))
    assert child["mark"] == "1" and not child["hooked"]  # e.g. a spawned DataLoader worker
    assert sorted(user_site_runs(tmp_path)) == sorted([agent["pid"], child["pid"]])  # the user's ran in both


@pytest.mark.parametrize("launcher", ["python", "program"])
def test_without_torchrun_every_process_waits_for_torch_unmarked_until_it_proves_a_rank(job, tmp_path, launcher):
    """The first process may be a launcher (accelerate's, deepspeed's, an mp.spawn parent)
    whose children are the ranks: it arms the torch hook but does not mark itself, so the
    processes it starts arm theirs too; a rank marks itself when it builds an optimizer."""
    make, user_site = job
    directory = make(launcher)
    first = probe(job_env(directory, user_site, tmp_path))
    assert first["mark"] is None and first["hooked"] and not first["torch_imported"]
    started_by_it = probe(job_env(directory, user_site, tmp_path, LOCAL_RANK="1"))  # e.g. Lightning's rank 1
    assert started_by_it["mark"] is None and started_by_it["hooked"]
    exported = probe(job_env(directory, user_site, tmp_path, RANK="0"))  # a batch script's export proves nothing
    assert exported["mark"] is None and exported["hooked"]
    elastic = probe(job_env(directory, user_site, tmp_path, TORCHELASTIC_RUN_ID="r"))  # accelerate launch's rank
    assert elastic["mark"] == str(elastic["pid"]) and elastic["hooked"]


def test_nested_bootstraps_run_msmon_once_and_the_user_sitecustomize_once(job, tmp_path):
    make, user_site = job
    inner, outer = make(), make()
    env = job_env(inner, user_site, tmp_path, TORCHELASTIC_RUN_ID="run1")
    env = job_directory.job_environment(env, outer, None)  # a job launched from inside another
    seen = probe(env)
    assert seen["sitecustomize"] == str(user_site / "sitecustomize.py")
    assert user_site_runs(tmp_path) == [seen["pid"]]


@pytest.mark.parametrize("flag", ["-E", "-I", "-S"])
def test_python_flags_that_skip_sitecustomize_are_detected(job, tmp_path, flag):
    make, user_site = job
    seen = probe(job_env(make(), user_site, tmp_path, TORCHELASTIC_RUN_ID="run1"), flag)
    assert seen["mark"] is None and not seen["hooked"]  # really not loaded
    command = parse(["--nproc-per-node", "1", "--no-python"], ["python3", flag, "train.py"], use_torchrun=True)
    assert sitecustomize_disabled_by(command) == flag
    clustered = parse(["--no-python"], ["python", "-u" + flag[1], "train.py"], use_torchrun=True)
    assert sitecustomize_disabled_by(clustered) == flag
    after_a_value = parse(["--no-python"], ["python", "-W", "ignore", flag, "train.py"], use_torchrun=True)
    assert sitecustomize_disabled_by(after_a_value) == flag
    assert sitecustomize_disabled_by(parse(["--no-python"], ["python", "-u", "train.py"], True)) is None
    assert sitecustomize_disabled_by(parse(["--no-python"], ["python", "-c", flag], True)) is None


def test_the_job_command_passes_torchrun_options_through_in_order(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    options = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--standalone"]
    command = parse(options, [str(script), "--lr", "0.1"], use_torchrun=True)
    assert command.argv() == [
        sys.executable,
        "-m",
        "msmon.launcher.bootstrap.torchrun",
        *options,
        str(script),
        "--lr",
        "0.1",
    ]
    module = parse(["--nproc-per-node", "2"], ["-m", "pkg.train", "--x"], use_torchrun=True)
    assert module.argv()[-5:] == ["--nproc-per-node", "2", "-m", "pkg.train", "--x"]
    assert parse([], ["--module", "pkg.train", "--x"], use_torchrun=False).argv() == [
        sys.executable,
        "-m",
        "pkg.train",
        "--x",
    ]


@pytest.mark.parametrize("no_torchrun", [True, False])
def test_a_program_target_is_run_as_it_is_never_as_a_python_file_nor_under_torchrun(tmp_path, monkeypatch, no_torchrun):
    """`-- python train.py` was run as `python python train.py` ("source code cannot contain null
    bytes"); `-- accelerate launch ...` was refused as a missing script."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    script = tmp_path / "train.py"
    script.write_text("")
    for target in (["python", str(script)], [sys.executable, str(script)], ["accelerate", "launch", str(script)]):
        command = parse([], target, use_torchrun=not no_torchrun)
        assert command.argv() == target and command.launcher == "program"
    assert parse([], [str(script)], use_torchrun=False).argv() == [sys.executable, str(script)]
    with pytest.raises(UsageError, match="'accelerate' is a program, not a Python script"):
        parse(["--nproc-per-node", "2"], ["accelerate", "launch", str(script)], use_torchrun=True)
    with pytest.raises(UsageError, match="nor a program of that name on PATH"):
        parse([], ["no-such-launcher-xyz", str(script)], use_torchrun=False)


@pytest.mark.parametrize(
    "torchrun_args, target, use_torchrun, message",
    [
        ([], None, True, "missing the training script"),
        ([], ["missing.py"], True, "training script 'missing.py' not found"),
        (["--nproc-per-node", "2"], ["-m", "pkg"], False, "cannot be used with --no-torchrun"),
        ([], ["-m"], True, "-m needs a module name"),
    ],
)
def test_command_line_mistakes_are_reported_before_starting(torchrun_args, target, use_torchrun, message):
    with pytest.raises(UsageError, match=message):
        parse(torchrun_args, target, use_torchrun)


def test_the_summary_names_what_each_worker_did(tmp_path):
    log_dir = tmp_path / "out" / "Dec02-rank0-x"
    log_dir.mkdir(parents=True)
    (log_dir / "summary.json").write_text(json.dumps({"steps_recorded": 7, "alerts": 2}))
    records = [
        {"rank": 1, "monitors": [], "skipped": []},
        {
            "rank": 0,
            "monitors": [
                {"rank": 0, "log_dir": str(log_dir), "output_base": str(tmp_path / "out"), "optimizer": "AdamW"}
            ],
        },
    ]
    records.sort(key=lambda r: r["rank"])
    lines = run_summary.summary_lines(records, "run")
    assert lines[0].startswith("msmon: rank 0: 7 steps recorded, 2 alerts raised -> ")
    assert lines[0].endswith("Dec02-rank0-x")
    assert lines[1] == "msmon: rank 1: nothing was monitored (no torch.optim optimizer was created)"
    assert "import msmon.auto" in run_summary.summary_lines([], "run")[0]


def test_the_copied_boot_module_imports_nothing_of_msmon_not_even_inside_functions():
    """boot.py runs as `_msmon_boot` before msmon is importable, and stays below the worker it
    starts: the worker's start is handed in by the sitecustomize, so boot names no msmon module."""
    import ast

    tree = ast.parse(open(boot.__file__, encoding="utf-8").read())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level]
    relative = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == [] and not [name for name in imported if name.split(".")[0] == "msmon"], imported
