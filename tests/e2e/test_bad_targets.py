"""A target that names no module of the model is bad input: with no code change (`msmon run`,
`import msmon.auto`) the job stops before training with the closest names, as the API's
set_monitor raises; a target another model of the process holds leaves this optimizer alone."""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from conftest import MLP, ROOT
from msmon import TrainerMon
from msmon.hooks import Session, StopBeforeTraining, torch_optim
from msmon.hooks import handover as framework_attach

SCRIPTS = ROOT / "tests" / "scripts"
CONFIG = {"wg_distribution": True, "format": ["csv"]}


@pytest.fixture
def instrumented(write_config, output_dir):
    """The torch.optim instrumentor on, with `targets`; everything undone after."""
    sessions = []

    def start(targets: dict) -> Session:
        session = Session.from_file(write_config({**CONFIG, "targets": targets}), TrainerMon)
        torch_optim.instrument(session)
        sessions.append(session)
        return session

    yield start
    torch_optim.uninstrument()
    for session in sessions:
        for monitor in list(session.monitors):
            monitor.close()


def test_a_target_naming_no_module_stops_at_the_optimizer_with_the_closest_names(instrumented, caplog):
    session = instrumented({"fc3": {}})
    model = MLP()
    with caplog.at_level(logging.ERROR, logger="msmon"), pytest.raises(StopBeforeTraining) as stop:
        torch.optim.AdamW(model.parameters(), lr=0.1)
    assert stop.value.code == 2 and isinstance(stop.value, SystemExit)
    assert session.error == "targets: 'fc3' names no module or parameter of the model; closest names: fc2, fc1"
    assert session.monitors == []
    (line,) = [r.getMessage() for r in caplog.records if "invalid config" in r.getMessage()]
    assert line.startswith(f"msmon[rank 0]: invalid config {session.config_path}: targets: 'fc3' names no module")
    assert line.endswith("; stopping before training")


def test_a_script_catching_exception_cannot_swallow_the_stop(instrumented):
    instrumented({"fc3": {}})
    model = MLP()
    with pytest.raises(SystemExit):
        try:
            torch.optim.SGD(model.parameters(), lr=0.1)
        except Exception:  # what a script's broad handler catches
            pytest.fail("the stop must not be an Exception")


def test_a_target_of_another_model_leaves_this_optimizer_alone_whatever_the_order(instrumented, caplog):
    session = instrumented({"disc.0": {}})
    generator, discriminator = MLP(), torch.nn.Sequential()
    discriminator.add_module("disc", torch.nn.Sequential(torch.nn.Linear(4, 1)))
    with caplog.at_level(logging.INFO, logger="msmon"):
        optimizers = [
            torch.optim.SGD(generator.parameters(), lr=0.1),  # its model lacks the target: built first
            torch.optim.SGD(discriminator.parameters(), lr=0.1),
        ]
    assert len(optimizers) == 2
    assert [m.models for m in session.monitors] == [[discriminator]]
    assert session.error is None
    assert "SGD is not monitored: the config's targets are not in its model" in caplog.text


def test_an_optimizer_met_at_its_first_step_stops_before_the_step_runs(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before msmon was loaded
    before = [p.detach().clone() for p in model.parameters()]
    session = Session.from_file(write_config({**CONFIG, "targets": {"layers.0": {}}}), TrainerMon)
    torch_optim.instrument(session)
    try:
        model(torch.randn(4, 8)).square().mean().backward()
        with pytest.raises(StopBeforeTraining):
            optimizer.step()
    finally:
        torch_optim.uninstrument()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step did not run
    assert "'layers.0' names no module" in session.error


def test_a_framework_optimizer_with_a_target_naming_no_module_stops(write_config, output_dir):
    session = Session.from_file(write_config({**CONFIG, "targets": {"fc3.weight": {}}}), TrainerMon)
    model = MLP()
    with pytest.raises(StopBeforeTraining):
        framework_attach.attach(session, model, torch.optim.SGD(model.parameters(), lr=0.1), "deepspeed.initialize")
    assert "'fc3.weight' names no module or parameter of the model; closest names: fc" in session.error
    good = Session.from_file(write_config({**CONFIG, "targets": {"fc2.weight": {}}}), TrainerMon)
    monitor = framework_attach.attach(good, model, torch.optim.SGD(model.parameters(), lr=0.1), "deepspeed.initialize")
    assert monitor is not None and [mp.name for mp in monitor.params] == ["fc2.weight"]
    monitor.close()


@pytest.mark.e2e
def test_msmon_run_stops_every_rank_before_training_and_says_why_once(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({**CONFIG, "targets": {"layers.2": {}}}))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "msmon.launcher",
            "run",
            "--config",
            str(config),
            "--output-dir",
            str(out),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--",
            str(SCRIPTS / "launcher_bad_target.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2  # the ranks' exit code
    assert proc.stdout.count("model built") == 2, proc.stdout + proc.stderr[-3000:]
    assert " step " not in proc.stdout  # no optimizer step ran on any rank
    reason = (
        "targets: 'layers.2' names no module or parameter of the model; closest names: layers.1, layers.0, layers, "
        "layers.1.bias, layers.0.bias"
    )
    # said once, plainly: no line per rank, no torchrun traceback or failure table around it
    assert proc.stderr.splitlines() == [f"msmon: invalid config {config}: {reason}; every rank stopped before training"]
    assert not glob.glob(str(out / "*-rank*"))


def test_the_end_of_job_summary_gives_a_config_error_once_whatever_the_ranks_it_stopped():
    from msmon.launcher.run_summary import summary_lines

    error = {"monitors": [], "skipped": [], "error": "targets: 'x' names no module"}
    lines = summary_lines(
        [{"rank": 0, **error}, {"rank": 1, "monitors": [], "skipped": []}], "run", config_source="m.json"
    )
    assert lines == ["msmon: invalid config m.json: targets: 'x' names no module; every rank stopped before training"]
    # rank 1 was stopped by torchrun
    monitored = {"rank": 2, "monitors": [{"rank": 2, "log_dir": None}], "skipped": []}
    lines = summary_lines([{"rank": 0, **error}, {"rank": 1, **error}, monitored], "run")
    assert lines[0] == "msmon: invalid config: targets: 'x' names no module; ranks 0, 1 stopped before training"
    assert lines[1:] == ["msmon: rank 2: not in the config's module_ranks, nothing recorded"]


def test_a_failed_attachment_is_reported_as_such_not_as_no_optimizer_built(write_config, tmp_path, monkeypatch):
    from msmon.launcher.bootstrap.worker import WorkerRecord
    from msmon.launcher.run_summary import summary_lines

    session = Session.from_file(write_config(CONFIG), TrainerMon)
    record = WorkerRecord(str(tmp_path / "workers"), session)
    session.listeners.append(record.on_event)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker / "out"))  # TrainerMon cannot open its output
    torch_optim.instrument(session)
    try:
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    finally:
        torch_optim.uninstrument()
    assert optimizer is not None and session.monitors == []
    (line,) = summary_lines([record.data], "run")
    assert line.startswith("msmon: rank 0: nothing was monitored (SGD: attaching failed: ConfigError(")
    assert "is not writable" in line
