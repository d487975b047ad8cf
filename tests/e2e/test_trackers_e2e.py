"""`format: ["csv", "wandb", "mlflow"]` under `msmon run` (real torchrun, 2 gloo ranks), with the real
clients: W&B offline (read back from the run's .wandb file with wandb's own reader, `wandb leet
inspect --json`) and MLflow on a local file store (read back with MlflowClient).

Two jobs: in the first the script makes its own W&B run (msmon logs into it, on msmon's own
step axis, and the script's steps stay whole) and msmon makes the MLflow run; in the second the
script starts its own MLflow run and msmon makes the W&B run, and rank 1's batch of step NAN_STEP
holds a NaN (AnomalyNan, the dump, and an escalation of alert.actions on NanOrigin). Each lane is
recomputed from the CSV both ranks wrote (the max and the median over tensors, a NaN the
largest, the rank and tensor holding the max, the loss per rank), every name is checked against
the tracker's rules and the keys against the budget, which the explicit tensors asked for
overrun (said once per tracker). The verdict both trackers get is the kind `msmon analyse` tells
from the dump (code, rank, first module), announced once, with the escalation summary.json
records."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import posixpath
import re
import statistics
import subprocess
import sys
from pathlib import Path

import mlflow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
import pytest
import wandb  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)

from conftest import ROOT, run_job

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "trackers_ddp.py"
STEPS = 4
MAX_KEYS = 120
CONFIG = {
    "format": ["csv", "wandb", "mlflow"],
    "wg_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "mv_distribution": True,
    "loss_distribution": True,
    "ops": ["norm", "max", "nans"],
    "ndigits": 12,  # the CSV the lanes are recomputed from, to 12 digits
    "tracker": {"project": "msmon-e2e", "max_keys": MAX_KEYS, "tensors": ["*/fc*"]},
}
NAN_RANK, NAN_STEP = 1, 1
NAN_CONFIG = {
    **CONFIG,
    "alert": {
        "rules": [{"rule_name": "AnomalyNan"}],
        "dump": True,
        "actions": [{"on": ["NanOrigin"], "do": "escalate", "for_steps": 1, "config": {"all_xy": True}}],
    },
}
ESCALATED = (NAN_STEP + 2, NAN_STEP + 2)  # read while the next step trains, decided at its end, from the step after
CATEGORIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg")
WANDB_NAME = re.compile(r"[_A-Za-z][_A-Za-z0-9]*(/[_A-Za-z][_A-Za-z0-9]*)*")
MLFLOW_NAME = re.compile(r"[A-Za-z0-9_\-. /]+")  # what MLflow takes on every system: no ':'


def _job(base: Path, *script_args: str, config_data: dict = CONFIG) -> dict:
    config, out = base / "monitor.json", base / "out"
    config.write_text(json.dumps(config_data))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_", "WANDB_"))}
    env.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(base),
        WANDB_SILENT="true",
        MLFLOW_TRACKING_URI=(base / "mlruns").as_uri(),
        MLFLOW_ALLOW_FILE_STORE="true",
    )
    proc = run_job(
        [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config), "--output-dir", str(out)]
        + ["--standalone", "--nproc-per-node", "2", "--", str(SCRIPT), "--steps", str(STEPS), *script_args],
        timeout=240,
        env=env,
        cwd=base,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"base": base, "out": out, "stderr": proc.stderr, "csv": read_csv(out), "wandb": read_wandb(base)}


@pytest.fixture(scope="module")
def script_made_wandb(tmp_path_factory) -> dict:
    # steps as long as real ones: the lanes of a step reach the script's run while the script still logs
    return _job(tmp_path_factory.mktemp("trackers_wandb"), "--wandb-run", "--step-seconds", "0.75")


@pytest.fixture(scope="module")
def script_made_mlflow(tmp_path_factory) -> dict:
    nan = ["--nan-rank", str(NAN_RANK), "--nan-step", str(NAN_STEP)]
    return _job(tmp_path_factory.mktemp("trackers_mlflow"), "--mlflow-run", *nan, config_data=NAN_CONFIG)


def read_csv(out: Path) -> dict[int, dict[str, list[dict[str, str]]]]:
    """rank -> category -> rows of every step."""
    found: dict[int, dict[str, list[dict[str, str]]]] = {}
    for directory in glob.glob(str(out / "*-rank*-*")):
        rank = int(Path(directory).name.split("-rank")[1].split("-")[0])
        for path in sorted(Path(directory).glob("*_[0-9]*.csv")):
            category = path.name.rsplit("_", 1)[0]
            with open(path, newline="") as fh:
                found.setdefault(rank, {}).setdefault(category, []).extend(csv.DictReader(fh))
    assert sorted(found) == [0, 1]
    return found


def read_wandb(base: Path) -> list[dict]:
    """Every offline run under `base`: its run record, history rows and alerts, read by wandb's reader."""
    runs = []
    for path in sorted(glob.glob(str(base / "wandb" / "offline-run-*" / "run-*.wandb"))):
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", path],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        runs.append(
            {
                "run": next(r["run"] for r in records if r["type"] == "run"),
                "history": [r["history"]["item"] for r in records if r["type"] == "history"],
                "alerts": [r["alert"] for r in records if r["type"] == "alert"],
                "exit": [r for r in records if r["type"] == "exit"],
            }
        )
    return runs


def _median(values: list[float]) -> float:
    """The median of the finite-or-infinite values, NaNs left out (NaN when none is left)."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def expected_lanes(tables: dict[int, dict[str, list[dict[str, str]]]], step: int) -> dict[str, object]:
    """The lanes of `step` recomputed from both ranks' CSV rows (a NaN is the largest value)."""
    lanes: dict[str, object] = {}
    for category in CATEGORIES:
        for op in CONFIG["ops"]:
            best = None  # (value, rank, tensor): the largest value, the first rank and row holding it
            medians = []
            for rank in sorted(tables):
                rows = [r for r in tables[rank].get(category, []) if int(r["step"]) == step]
                if not rows:
                    continue
                values = [float(r[op]) for r in rows]
                medians.append(_median(values))
                nans = [i for i, v in enumerate(values) if math.isnan(v)]
                at = nans[0] if nans else values.index(max(values))
                row = rows[at]
                name = f"{row['vpp_stage']}:{row['name']}" + (f":{row['micro_step']}" if row.get("micro_step") else "")
                if (
                    best is None
                    or (nans and not math.isnan(best[0]))
                    or (not math.isnan(best[0]) and values[at] > best[0])
                ):
                    best = (values[at], rank, name)
            assert best is not None, (category, op)
            lanes[f"msmon/{category}/{op}_max"] = best[0]
            lanes[f"msmon/{category}/{op}_max_rank"] = float(best[1])
            lanes[f"msmon/{category}/{op}_max_tensor"] = best[2]
            lanes[f"msmon/{category}/{op}_median"] = _median(medians)
    losses = [statistics.mean(float(r["value"]) for r in tables[k]["loss"] if int(r["step"]) == step) for k in tables]
    nan_loss = any(math.isnan(v) for v in losses)
    lanes["msmon/loss/min"] = math.nan if nan_loss else min(losses)
    lanes["msmon/loss/max"] = math.nan if nan_loss else max(losses)
    lanes["msmon/loss/median"] = _median(losses)
    return lanes


def clean(lanes: dict[str, object]) -> dict[str, object]:
    """A step with no alert: level 0, no alert, the verdict ok."""
    return {**lanes, "msmon/verdict": 0.0, "msmon/alerts": 0.0, "msmon/verdict_text": "ok"}


def fc1_input_norm(job: dict, step: int) -> float:
    (row,) = [r for r in job["csv"][0]["actv"] if r["name"] == "fc1.input" and int(r["step"]) == step]
    return float(row["norm"])


def assert_lanes(got: dict[str, object], expected: dict[str, object], where: str) -> None:
    for key, value in expected.items():
        assert key in got, (where, key)
        if isinstance(value, str):
            assert got[key] == value, (where, key)
        else:  # W&B's history holds a NaN as "NaN"
            number = float(got[key]) if got[key] in ("NaN", "Infinity", "-Infinity") else got[key]
            assert number == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), (where, key)


@pytest.fixture
def mlflow_runs(monkeypatch):
    """Every MLflow run of a job's local file store, with a client reading it."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def read(base: Path) -> list:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=(base / "mlruns").as_uri())
        return [(client, run) for e in client.search_experiments() for run in client.search_runs([e.experiment_id])]

    return read


def mlflow_lanes(client, run, step: int) -> dict[str, object]:
    got: dict[str, object] = {}
    for key in run.data.metrics:
        points = [m for m in client.get_metric_history(run.info.run_id, key) if m.step == step]
        if points:
            assert len(points) == 1, (key, step)  # one point per recorded step
            got[key] = points[0].value
    return got


def test_wandb_logs_into_the_scripts_own_run_on_its_own_step_axis(script_made_wandb):
    job = script_made_wandb
    (run,) = job["wandb"]  # one run: the script's
    assert run["run"]["display_name"] == "script-run" and run["run"]["project"] == "script"
    script_rows = [row for row in run["history"] if "loss" in row]
    assert [row["_step"] for row in script_rows] == list(range(STEPS))  # the script's own steps, none lost
    ours = [row for row in run["history"] if "msmon/step" in row]
    # msmon's lanes join the row the script is logging (commit=False): a row holds the last lanes
    # before it, and the lanes that come after the script finished its run are not sent (said once)
    assert ours and len({row["msmon/step"] for row in ours}) == len(ours)
    for row in ours:
        assert_lanes(row, clean(expected_lanes(job["csv"], int(row["msmon/step"]))), "wandb")
    assert not run["alerts"]  # a finite training: nothing announced


def test_wandb_run_msmon_makes_has_one_row_per_step_every_lane_as_the_csv_and_valid_names(
    script_made_mlflow, nan_verdict
):
    job = script_made_mlflow
    (run,) = job["wandb"]
    run_id = json.loads(next((job["out"]).glob("*-rank0-*/run.json")).read_text())["runs"][0]["run_id"]
    assert run["run"]["display_name"] == run_id and run["run"]["project"] == CONFIG["tracker"]["project"]
    rows = [row for row in run["history"] if "msmon/step" in row]
    assert [int(row["msmon/step"]) for row in rows] == list(range(STEPS))  # one point per recorded step
    for row in rows:
        step = int(row["msmon/step"])
        assert_lanes(row, {**expected_lanes(job["csv"], step), **nan_verdict["lanes"][step]}, "wandb")
    keys = {k for row in run["history"] for k in row if not k.startswith("_")}
    assert all(WANDB_NAME.fullmatch(k) for k in keys), sorted(k for k in keys if not WANDB_NAME.fullmatch(k))
    assert len(keys) == MAX_KEYS  # the explicit tensors fill the budget, and no more is sent
    for row in rows:  # an explicit tensor: rank 0's value (the logging rank's)
        assert row["msmon/tensor/actv/fc1_input/micro0/norm"] == pytest.approx(fc1_input_norm(job, row["msmon/step"]))
    assert job["stderr"].count("the W&B run's key budget (tracker.max_keys = 120) is full") == 1
    assert run["exit"]  # msmon finished its own run


def test_mlflow_run_msmon_makes_has_one_point_per_step_every_lane_as_the_csv_and_valid_names(
    script_made_wandb, mlflow_runs
):
    job = script_made_wandb
    found = mlflow_runs(job["base"])
    assert len(found) == 1  # one run, msmon's, in the experiment named by tracker.project
    client, run = found[0]
    assert client.get_experiment(run.info.experiment_id).name == CONFIG["tracker"]["project"]
    assert run.info.run_name == run.data.tags["msmon.run"] and run.info.status == "FINISHED"
    texts = {k: v for k, v in run.data.tags.items() if k.startswith("msmon/")}
    for step in range(STEPS):
        got = mlflow_lanes(client, run, step)
        expected = clean(expected_lanes(job["csv"], step))
        if step < STEPS - 1:  # the holders are tags: the last step's are the ones kept
            expected = {k: v for k, v in expected.items() if not k.endswith("_max_tensor")}
        assert_lanes({**got, **texts}, expected, f"mlflow step {step}")
        assert got["msmon/tensor/actv/fc1.input/micro0/norm"] == pytest.approx(fc1_input_norm(job, step))
    keys = set(run.data.metrics) | set(texts)
    assert all(MLFLOW_NAME.fullmatch(k) and posixpath.normpath(k) == k for k in keys)
    assert len(keys) == MAX_KEYS
    assert job["stderr"].count("the MLflow run's key budget (tracker.max_keys = 120) is full") == 1
    assert run.data.tags["msmon.verdict"] == "ok"
    assert not any(k.startswith(("msmon.verdict.", "msmon.first_", "msmon.escalation")) for k in run.data.tags)


def test_mlflow_logs_into_the_scripts_own_run(script_made_mlflow, nan_verdict, mlflow_runs):
    job = script_made_mlflow
    found = mlflow_runs(job["base"])
    assert len(found) == 1  # the script's run; msmon made none
    client, run = found[0]
    assert run.info.run_name == "script-run" and "msmon.run" not in run.data.tags
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(STEPS))
    for step in range(STEPS):
        got = mlflow_lanes(client, run, step)
        expected = {**expected_lanes(job["csv"], step), **nan_verdict["lanes"][step]}
        texts = ("_max_tensor", "verdict_text")  # tags: the last step's are the ones kept
        assert_lanes(got, {k: v for k, v in expected.items() if not k.endswith(texts)}, f"mlflow step {step}")


def test_the_lanes_are_logged_from_rank_0_alone(script_made_mlflow):
    stderr = script_made_mlflow["stderr"]
    assert "msmon[rank 0]: the wandb and mlflow lanes of ranks [0, 1] are logged from this rank" in stderr
    assert "msmon[rank 1]: the wandb" not in stderr


@pytest.fixture(scope="module")
def nan_verdict(script_made_mlflow) -> dict:
    """What `msmon analyse` tells from the NaN job's dump (its JSON), the escalation summary.json
    records, and each step's verdict lanes as they follow from them (the alerts counted in the dump)."""
    out = script_made_mlflow["out"]
    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(out / "anomaly_detected")],
        capture_output=True,
        text=True,
    )
    assert analysed.returncode == 0, analysed.stderr
    kind = json.loads((out / "anomaly_detected" / "msmon_analyse.json").read_text())["kind"]
    dumped: dict[int, int] = {}
    for path in out.glob("anomaly_detected/rank*/anomaly.jsonl"):
        for line in path.read_text().splitlines():
            step = json.loads(line)["step"]
            dumped[step] = dumped.get(step, 0) + 1
    said = f"{kind['code']}: {kind['kind']} (step {kind['step']}, rank {kind['rank']}, first module {kind['module']})"
    lanes = {}
    for step in range(STEPS):
        lanes[step] = {
            "msmon/verdict": 2.0 if step == NAN_STEP else 0.0,  # the lanes hold a NaN at that step only
            "msmon/alerts": float(dumped.get(step, 0)),
            "msmon/verdict_text": said if step >= NAN_STEP else "ok",
        }
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("*-rank*-*/summary.json"))]
    return {"kind": kind, "said": said, "lanes": lanes, "escalations": [s["escalations"] for s in summaries]}


def test_both_trackers_verdict_is_the_kind_msmon_analyse_tells_announced_once_with_the_escalation(
    script_made_mlflow, nan_verdict, mlflow_runs
):
    kind = nan_verdict["kind"]
    assert (kind["code"], kind["rank"], kind["step"]) == ("one_rank_data", NAN_RANK, NAN_STEP)  # a bad batch
    (record,) = nan_verdict["escalations"][0]
    assert nan_verdict["escalations"] == [[record], [record]]  # the same on both ranks
    assert (record["first_step"], record["last_step"], record["alert_step"]) == (*ESCALATED, NAN_STEP)
    (run,) = script_made_mlflow["wandb"]  # msmon's W&B run: a W&B alert each
    told, escalation = run["alerts"]
    assert told["title"] == f"msmon: {kind['kind']} (step {NAN_STEP}, rank {NAN_RANK}, first module {kind['module']})"
    assert told["level"] == "ERROR" and told["text"].startswith(f"{kind['code']}: {kind['why']}. ")
    assert f"What to do: {kind['action']}." in told["text"] and f"At step {NAN_STEP}: non-finite: " in told["text"]
    assert escalation["title"] == f"msmon: escalation of steps {ESCALATED[0]} to {ESCALATED[1]}"
    assert escalation["text"].endswith(record["why"]) and escalation["level"] == "WARN"
    ((_, mlflow_run),) = mlflow_runs(script_made_mlflow["base"])  # the script's MLflow run: tags
    tags = mlflow_run.data.tags
    assert tags["msmon.verdict"] == kind["code"] and tags["msmon.verdict.rank"] == str(kind["rank"])
    assert tags["msmon.verdict.module"] == kind["module"] and tags["msmon.verdict.action"] == kind["action"]
    assert tags["msmon/verdict_text"] == nan_verdict["said"]
    assert tags["msmon.escalation.1"] == escalation["text"] and "msmon.escalation.2" not in tags
    assert tags["msmon.first_nonfinite"].startswith(f"step {NAN_STEP}: non-finite: ")
