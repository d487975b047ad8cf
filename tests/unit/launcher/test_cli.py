"""The `msmon` command line: mistakes refused before a job starts, `--no-torchrun` jobs, exit
codes and tracebacks passed through, the summary printed at the end."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT, read_csv_rows
from msmon.launcher.analyse_command import analyse
from msmon.launcher.cli import main
from msmon.output.sinks import format_names

SCRIPTS = ROOT / "tests" / "scripts"
MSMON = [sys.executable, "-m", "msmon.launcher"]


_KEPT = ("MSMON_NATIVE_STATS", "MSMON_CACHE_DIR")  # conftest's: torch reductions, and never ~/.cache


def msmon(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 240):
    proc = subprocess.run(
        [*MSMON, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={k: v for k, v in (env or os.environ).items() if not k.startswith("MSMON_") or k in _KEPT},
    )
    return proc


def test_run_wants_a_double_dash_before_the_training_script(tmp_path):
    result = CliRunner().invoke(main, ["run", "--nproc-per-node", "2", str(SCRIPTS / "launcher_single.py")])
    assert result.exit_code == 2
    assert "missing the training script" in result.output and "-- train.py" in result.output


def test_an_invalid_config_is_refused_before_the_job_starts(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "opss": ["norm"]}))
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = CliRunner().invoke(main, ["run", "--config", str(config), "--no-torchrun", "--", str(script)])
    assert result.exit_code == 1
    assert "invalid config" in result.output and "did you mean 'ops'" in result.output
    assert not marker.exists()


# The launcher's process with torch refused: `msmon run` checks the config (the format names
# included) and starts the job without it.
NO_TORCH_MSMON = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test: {name}")
        return None

sys.meta_path.insert(0, NoTorch())
from msmon.launcher.cli import main

main(args=sys.argv[1:], prog_name="msmon")
"""


def no_torch_msmon(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSMON_") or k in _KEPT}
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH_MSMON, *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_msmon_run_refuses_an_unknown_format_before_torchrun_starts_without_importing_torch(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": ["csv", "hdf5"]}))
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    args = ["run", "--config", str(config), "--nproc-per-node", "2", "--", str(script)]
    proc = no_torch_msmon(*args)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"Error: invalid config: {config}: format: unknown format 'hdf5'; expected {format_names()}"
    ]
    assert not marker.exists()  # torchrun never started


def test_msmon_run_accepts_every_sink_files_format_without_importing_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "monitor_output"))
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": ["api", "csv", "tensorboard"]}))
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    args = ["run", "--config", str(config), "--no-torchrun", "--", str(script)]
    proc = no_torch_msmon(*args)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()


@pytest.mark.parametrize(
    "name, data, message",
    [
        (
            "monitor.json",
            '{"wg_distribution": true,\n "ops": ["norm"\uff0c "max"]}'.encode("gbk"),
            "is not UTF-8: line 2, column 16: byte 0xA3 (in GBK, '\uff0c' U+FF0C FULLWIDTH COMMA); save the file as UTF-8",  # noqa: E501
        ),
        (
            "monitor.json",
            '{"wg_distribution": true\uff0c "ops": ["norm"]}'.encode(),
            ": line 1, column 25: '\uff0c' U+FF0C FULLWIDTH COMMA is not ASCII; write ',' instead",
        ),
        (
            "monitor.yaml",
            "# \u914d\u7f6e\uff0c\u68af\u5ea6\nwg_distribution\uff1a true\n".encode(),
            ": line 2, column 16: '\uff1a' U+FF1A FULLWIDTH COLON is not ASCII; write ':' instead",
        ),
        (
            "monitor.json",
            b'{"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": NaN}}]}}',
            ": alert.rules[0].args.threshold: expected a positive number, got nan (not a finite number)",
        ),
    ],
)
def test_a_config_not_utf8_full_width_or_non_finite_is_one_line_before_any_worker_starts(tmp_path, name, data, message):
    config = tmp_path / name
    config.write_bytes(data)
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = msmon("run", "--config", str(config), "--nproc-per-node", "2", "--", str(script), timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: invalid config: ") and f"{config}" in lines[0], proc.stderr
    assert lines[0].endswith(message)
    assert not marker.exists()  # torchrun never started


def test_an_unwritable_output_directory_is_refused_before_the_job_starts(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = CliRunner().invoke(
        main, ["run", "--output-dir", str(blocker / "out"), "--no-torchrun", "--", str(SCRIPTS / "launcher_single.py")]
    )
    assert result.exit_code == 1
    assert "is not writable" in result.output


def test_torchrun_options_cannot_be_mixed_with_no_torchrun():
    result = CliRunner().invoke(
        main, ["run", "--no-torchrun", "--nnodes", "2", "--", str(SCRIPTS / "launcher_single.py")]
    )
    assert result.exit_code == 2
    assert "--nnodes 2 cannot be used with --no-torchrun" in result.output


def test_analyse_takes_several_steps_after_one_option(tmp_path):
    context = analyse.make_context("analyse", ["-d", str(tmp_path), "-s", "3", "4", "5", "-k", "2"])
    assert context.params["steps"] == (3, 4, 5) and context.params["top_k"] == 2
    bad = CliRunner().invoke(main, ["analyse", "-d", str(tmp_path), "-s", "three"])
    assert bad.exit_code == 2 and "'three' is not a valid integer" in bad.output
    help_text = CliRunner().invoke(main, ["analyse", "--help"]).output
    assert "-s, --steps" in help_text and "-k, --top-k" in help_text and "-o, --output" in help_text


@pytest.mark.e2e
def test_no_torchrun_runs_one_process_with_the_default_config(tmp_path):
    out = tmp_path / "out"
    on_path = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = msmon(
        "run", "--output-dir", str(out), "--no-torchrun", "--", str(SCRIPTS / "launcher_single.py"), env=on_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "no --config given; using the built-in default config" in proc.stderr
    assert '"wg_distribution": true' in proc.stderr  # the default, printed
    assert proc.stdout.count("step ") == 3
    (rank_dir,) = glob.glob(str(out / "*-rank0-*"))
    assert {r["step"] for r in read_csv_rows(Path(rank_dir), "grad_reduced")} == {"0", "1", "2"}
    assert (Path(rank_dir) / "config.json").exists()
    rank_line, next_line = proc.stderr.strip().splitlines()[-2:]
    assert rank_line.startswith("msmon: rank 0: 3 steps recorded, 0 alerts raised, monitor cost ")
    assert rank_line.endswith(Path(rank_dir).name)
    assert "% of step time" in rank_line and "steps recorded; monitor cost" not in proc.stderr  # the launcher's only
    # the default config dumps its alerts, so `msmon analyse` has a dump to read; the last line says where
    assert (out / "anomaly_detected" / "rank0").is_dir()
    run_id = json.loads((Path(rank_dir) / "run.json").read_text())["runs"][0]["run_id"]
    assert next_line == (
        f"msmon: run {run_id}; next: msmon analyse -d {out / 'anomaly_detected'} (the first anomaly across ranks), "
        f"msmon report -d {out} --run {run_id} -o report.html (one HTML page)"
    )


@pytest.mark.e2e
def test_no_torchrun_runs_a_python_command_line_as_it_is(tmp_path):
    """`-- python train.py` used to be run as `python <the python binary> train.py`: "source code
    cannot contain null bytes"."""
    out = tmp_path / "out"
    command = [sys.executable, "-u", str(SCRIPTS / "launcher_single.py")]
    proc = msmon("run", "--output-dir", str(out), "--no-torchrun", "--", *command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step ") == 3
    (rank_dir,) = glob.glob(str(out / "*-rank0-*"))
    assert {r["step"] for r in read_csv_rows(Path(rank_dir), "grad_reduced")} == {"0", "1", "2"}
    assert proc.stderr.strip().splitlines()[-2].startswith("msmon: rank 0: 3 steps recorded")  # then the next steps


@pytest.mark.e2e
def test_a_crash_keeps_its_traceback_and_exit_code_and_what_was_recorded(tmp_path):
    out = tmp_path / "out"
    crash = msmon(
        "run", "--output-dir", str(out), "--no-torchrun", "--", str(SCRIPTS / "launcher_single.py"), "--crash-at", "1"
    )
    assert crash.returncode == 1
    assert "Traceback (most recent call last)" in crash.stderr and "ValueError: crash at step 1" in crash.stderr
    assert "msmon: rank 0: 1 steps recorded" in crash.stderr  # step 0 was written before the crash
    code = msmon(
        "run", "--output-dir", str(out), "--no-torchrun", "--", str(SCRIPTS / "launcher_single.py"), "--exit-code", "3"
    )
    assert code.returncode == 3, code.stderr


@pytest.mark.e2e
def test_a_script_without_an_optimizer_runs_and_its_summary_says_nothing_was_monitored(tmp_path):
    out = tmp_path / "out"
    proc = msmon("run", "--output-dir", str(out), "--no-torchrun", "--", str(SCRIPTS / "launcher_manual_sgd.py"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("step ") == 3
    (rank_dir,) = glob.glob(str(out / "*-rank0-*"))
    summary = json.loads((Path(rank_dir) / "summary.json").read_text())
    assert summary["steps_recorded"] == 0 and summary["note"] == "no torch.optim optimizer was created"
    assert f"msmon: rank 0: nothing was monitored (no torch.optim optimizer was created) -> {rank_dir}" in proc.stderr


@pytest.mark.e2e
def test_python_E_is_detected_and_import_msmon_auto_still_monitors(tmp_path):
    out = tmp_path / "out"
    proc = msmon(
        "run",
        "--output-dir",
        str(out),
        "--nproc-per-node",
        "1",
        "--no-python",
        "--",
        sys.executable,
        "-E",
        str(SCRIPTS / "launcher_auto_fallback.py"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "skips sitecustomize, so msmon cannot load by itself" in proc.stderr and "import msmon.auto" in proc.stderr
    assert "trained" in proc.stdout
    assert "msmon: rank 0: 2 steps recorded, 0 alerts raised" in proc.stderr
    (rank_dir,) = glob.glob(str(out / "*-rank0-*"))
    assert read_csv_rows(Path(rank_dir), "grad_reduced")


def _job_dirs(tmp: Path) -> set[Path]:
    return set(tmp.glob("msmon-job-*"))


def _start_sleeping_job(tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A real `msmon run` whose job sleeps, in a session of its own; returns it and its
    bootstrap directory once the job runs."""
    before = _job_dirs(tmp)
    marker = tmp.parent / f"{name}.running"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSMON_")}
    env["TMPDIR"] = str(tmp)
    proc = subprocess.Popen(
        [*MSMON, "run", "--no-torchrun", "--", str(SCRIPTS / "launcher_sleep.py"), str(marker), "300"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, "the sleeping job did not start"
        time.sleep(0.1)
    (directory,) = _job_dirs(tmp) - before
    return proc, directory


@pytest.mark.e2e
def test_bootstrap_dirs_left_by_kill_9_are_removed_by_the_next_run_and_live_jobs_keep_theirs(tmp_path):
    from msmon.launcher.bootstrap.job_directory import STALE_AFTER_S

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    killed, killed_dir = _start_sleeping_job(tmp, "killed")
    orphaned, orphaned_dir = _start_sleeping_job(tmp, "orphaned")
    try:
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher and its job, as the OOM killer or a scheduler would
        os.kill(orphaned.pid, signal.SIGKILL)  # the launcher only: its job sleeps on
        killed.wait(timeout=60)
        orphaned.wait(timeout=60)
        assert killed_dir.is_dir() and orphaned_dir.is_dir()  # nobody could clean up
        time.sleep(max(0.0, STALE_AFTER_S + 0.5 - (time.time() - killed_dir.stat().st_mtime)))

        env = {k: v for k, v in os.environ.items() if not k.startswith("MSMON_")}
        env["TMPDIR"] = str(tmp)
        proc = msmon(
            "run", "--no-torchrun", "--", str(SCRIPTS / "launcher_sleep.py"), str(tmp_path / "next"), "0", env=env
        )
        assert proc.returncode == 0, proc.stderr
        assert _job_dirs(tmp) == {orphaned_dir}  # the dead job's removed, the live job's kept, the new one's cleaned
    finally:
        os.killpg(orphaned.pid, signal.SIGKILL)  # its job, still in the launcher's session
    time.sleep(STALE_AFTER_S + 0.5)
    proc = msmon("run", "--no-torchrun", "--", str(SCRIPTS / "launcher_sleep.py"), str(tmp_path / "last"), "0", env=env)
    assert proc.returncode == 0, proc.stderr
    assert _job_dirs(tmp) == set()  # its job ended too: now it is stale


def test_the_top_level_help_lists_each_commands_first_sentence_whole():
    from msmon.launcher.cli import first_sentence

    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    listing = result.output.split("Commands:")[1]
    assert "..." not in listing  # click's cut-off summaries
    flat = " ".join(listing.split())
    for name, command in main.commands.items():
        sentence = first_sentence(command.help or "")
        assert sentence.endswith(".") and f"{name} {sentence}" in flat, name
    convert = CliRunner().invoke(main, ["convert", "--help"], terminal_width=80)
    flat = " ".join(convert.output.split("Commands:")[1].split())
    assert "tb2csv TensorBoard events of each rank to CSV files, as the live CSV sink writes them." in flat


def test_the_shell_completion_the_readme_documents_completes_msmons_verbs():
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "_MSMON_COMPLETE=bash_source msmon" in line)
    assert line.startswith('eval "$(_MSMON_COMPLETE=bash_source msmon)"')
    program = Path(sys.executable).parent / "msmon"  # the console script pip installs beside python
    source = subprocess.run(
        [str(program)], env=dict(os.environ, _MSMON_COMPLETE="bash_source"), capture_output=True, text=True
    )
    assert source.returncode == 0 and "complete -o nosort -F _msmon_completion msmon" in source.stdout
    words = subprocess.run(
        [str(program)],
        env=dict(os.environ, _MSMON_COMPLETE="bash_complete", COMP_WORDS="msmon con", COMP_CWORD="1"),
        capture_output=True,
        text=True,
    )
    assert words.stdout.split() == ["plain,convert"]


def test_the_demos_tensorboard_hint_is_a_command_that_exists():
    makefile = (ROOT / "Makefile").read_text()
    (hint,) = [line for line in makefile.splitlines() if "--logdir" in line]
    program = hint.split("--logdir")[0].split()[-1]
    assert program == "$(BIN)/tensorboard"  # not a bare `tensorboard`: the .venv is not on PATH
    assert (Path(sys.executable).parent / "tensorboard").is_file()  # $(BIN): the bin folder of the venv's python
