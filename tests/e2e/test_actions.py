"""alert.actions on real torchrun ranks (2, gloo, CPU), each job read by several tests:

- escalate: one rank's batch goes bad at step BAD; every rank records activations for the same 3
  steps (the alert is read while the next step trains, the ranks decide at its end, the escalation
  starts at the step after: BAD+2 to BAD+4) and no others, and the weights after every step are
  bit for bit a plain torchrun run's. The same job configures skip_step on a rule that never
  fires (nothing changes), and notifies a local HTTP server (one POST per rule and tensor) and a
  second one that sleeps 10 s per request (the job never waits for it);
- skip_step: a loss spike at step SPIKE leaves every rank's weights as they were, training goes
  on, summary.json counts 1 skip, Megatron's tracker and Lightning's skip_batches.json name it;
- stop: a replica fault on one rank, `stop` on verdict:one_rank_model_copy: `msmon run` exits 16;
  run again into the same output root, the incident ledger turns the same fault at the same step
  into 17 with one line saying why;
- a rank killed while the others vote: they end at once, each with one clear line, no hang.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_job
from local_endpoint import Endpoint

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "tests" / "scripts" / "actions_train.py")
BAD, SPIKE, FLIP, KILL = 6, 7, 4, 5  # the steps of the faults the jobs order
TURBULENCE = {"rule_name": "AnomalyTurbulence", "args": {"threshold": 3}}


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    out["OMP_NUM_THREADS"] = "1"
    return out


def msmon_run(config: dict, out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(path), "--output-dir", str(out)]
    return run_job([*argv, "--standalone", "--nproc-per-node", "2", "--", SCRIPT, *args], timeout=timeout, env=env())


def rank_dirs(out: Path) -> dict[int, Path]:
    found = {}
    for path in sorted(glob.glob(str(out / "*-rank*-*"))):
        found[int(re.search(r"-rank(\d+)-", path)[1])] = Path(path)  # the newest run's, last
    return found


def summary(out: Path, rank: int) -> dict:
    return json.loads((rank_dirs(out)[rank] / "summary.json").read_text())


def hashes(directory: Path, rank: int) -> list[str]:
    return (directory / f"rank{rank}.txt").read_text().splitlines()


def csv_steps(rank_dir: Path, category: str) -> set[int]:
    """The steps of a category's CSV files (one step per file)."""
    names = [p.name for p in rank_dir.glob(f"{category}_*.csv")]
    return {int(m[1]) for name in names if (m := re.fullmatch(rf"{category}_(\d+)-\1\.csv", name))}


@pytest.fixture(scope="module")
def escalation(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("escalate")
    fast, slow = Endpoint(), Endpoint(delay=10.0)
    try:
        args = ["--steps", "14", "--bad-rank", "1", "--bad-step", str(BAD)]
        (tmp / "plain").mkdir()
        plain = run_job(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args,
             "--hashes", str(tmp / "plain")],
            timeout=240, env=env(),
        )  # fmt: skip
        assert plain.returncode == 0, plain.stderr[-3000:]
        (tmp / "monitored").mkdir()
        config = {
            "wg_distribution": True,
            "format": ["csv"],
            "ops": ["norm", "max"],
            "alert": {
                "rules": [TURBULENCE, {"rule_name": "AnomalyNan"}],
                "dump": True,
                "actions": [
                    {"on": ["AnomalyTurbulence"], "do": "escalate", "for_steps": 3, "config": {"all_xy": True}},
                    {"on": ["AnomalyNan"], "do": "skip_step"},  # no NaN in this job: configured, never firing
                    {"on": ["AnomalyTurbulence"], "do": "notify", "url": fast.url},
                    {"on": ["AnomalyTurbulence"], "do": "notify", "url": slow.url, "timeout": 20, "retries": 1},
                ],
            },
        }
        proc = msmon_run(config, tmp / "out", *args, "--hashes", str(tmp / "monitored"))
        slow_finished_when_the_job_ended = slow.finished
        yield {
            "proc": proc, "out": tmp / "out", "plain": tmp / "plain", "monitored": tmp / "monitored",
            "posts": list(fast.bodies), "slow_arrived": list(slow.arrived),
            "slow_finished": slow_finished_when_the_job_ended,
        }  # fmt: skip
    finally:
        fast.close()
        slow.close()


def test_escalation_records_activations_on_every_rank_for_the_same_three_steps_and_no_others(escalation):
    proc, out = escalation["proc"], escalation["out"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    escalated = {BAD + 2, BAD + 3, BAD + 4}
    for rank, directory in rank_dirs(out).items():
        assert csv_steps(directory, "actv") == escalated, rank
        assert csv_steps(directory, "actv_grad") == escalated, rank
        assert csv_steps(directory, "grad_reduced") == set(range(14))  # the base config all along
        (record,) = summary(out, rank)["escalations"]
        assert (record["first_step"], record["last_step"], record["alert_step"]) == (BAD + 2, BAD + 4, BAD)
        assert record["keys"] == ["all_xy"] and "AnomalyTurbulence" in record["why"]
    said = [line for line in proc.stderr.splitlines() if "msmon: escalation from step" in line]
    assert len(said) == 1 and said[0].startswith(f"msmon: escalation from step {BAD + 2} to {BAD + 4} on every rank")


def test_summary_counts_the_end_of_step_rounds_and_their_time_on_every_rank(escalation):
    for rank in rank_dirs(escalation["out"]):
        vote = summary(escalation["out"], rank)["vote"]
        assert vote["rounds"] == 14, vote  # one round at the end of every step
        assert 0 < vote["round_seconds"] < 60 and vote["reader_wait_seconds"] >= 0, vote


def test_training_under_escalation_and_an_idle_skip_step_is_bit_identical_to_a_plain_torchrun_run(escalation):
    for rank in (0, 1):
        monitored, plain = hashes(escalation["monitored"], rank), hashes(escalation["plain"], rank)
        assert len(plain) == 14 and monitored == plain
    assert [summary(escalation["out"], rank)["skips"] for rank in (0, 1)] == [0, 0]


def test_notify_posts_once_per_rule_and_tensor_of_the_steps_the_ranks_voted_on(escalation):
    out, posts = escalation["out"], escalation["posts"]
    dumps = [out / "anomaly_detected" / f"rank{rank}" / "anomaly.jsonl" for rank in (0, 1)]
    dumped = [json.loads(line) for dump in dumps for line in dump.open()]
    voted = [r for r in dumped if r["step"] <= 12]  # the last step's alerts have no later step to be voted at
    expected = {(r["rule"], r["category"], r["name"]) for r in voted}
    assert expected and len(posts) == len(expected)
    assert {(p["rule"], p["category"], p["tensor"]) for p in posts} == expected
    for post in posts:  # sent at the first step the rule alerted on the tensor, naming every rank that did then
        same = [
            r
            for r in voted
            if (r["rule"], r["category"], r["name"]) == (post["rule"], post["category"], post["tensor"])
        ]
        first = min(r["step"] for r in same)
        assert post["step"] == first and post["ranks"] == sorted({r["rank"] for r in same if r["step"] == first})
        assert post["text"].startswith(f"msmon alert at step {first}: AnomalyTurbulence on the ")


def test_an_endpoint_that_sleeps_10_s_never_holds_the_job_back(escalation):
    assert escalation["slow_arrived"], "the slow endpoint got no request"
    assert escalation["slow_finished"] == 0  # the job ended before the endpoint answered even once
    notify = summary(escalation["out"], 0)["notify"]  # rank 0 sends for the job
    assert notify["sent"] == len(escalation["posts"]) and notify["dropped"] >= 1 and notify["close_seconds"] < 1.0
    assert "notify" not in summary(escalation["out"], 1)


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skip")
    config = {
        "wg_distribution": True,
        "loss_distribution": True,
        "format": ["csv"],
        "ops": ["norm", "max"],
        "alert": {
            "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 30}}],
            "actions": [{"on": ["AnomalyTurbulence"], "do": "skip_step"}],
        },
    }
    (tmp / "hashes").mkdir()
    proc = msmon_run(config, tmp / "out", "--steps", "12", "--spike-step", str(SPIKE), "--hashes", str(tmp / "hashes"))
    return proc, tmp / "out", tmp / "hashes"


def test_a_loss_spike_step_is_not_applied_on_any_rank_and_training_goes_on(skipped):
    proc, out, directory = skipped
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        after = [line.split()[1] for line in hashes(directory, rank)]
        assert len(after) == 12
        assert after[SPIKE] == after[SPIKE - 1]  # the weights after the spike's step are those before it
        assert len(set(after)) == 11  # every other step changed them
        record = summary(out, rank)
        assert record["skips"] == 1 and [s["step"] for s in record["skipped_steps"]] == [SPIKE]
    assert hashes(directory, 0) == hashes(directory, 1)  # the replicas stayed replicas
    said = [line for line in proc.stderr.splitlines() if "is not applied on any rank" in line]
    assert len(said) == 1 and said[0].startswith(f"msmon: step {SPIKE} is not applied on any rank (alert.actions[0]")


def test_the_skipped_step_is_written_for_megatron_and_lightning_in_the_output_root(skipped):
    _, out, _ = skipped
    (line,) = (out / "result_rejected_tracker.txt").read_text().splitlines()
    assert f"iteration={SPIKE + 1} status=second_rerun_reproducible result=skipped_by_msmon" in line
    assert json.loads((out / "skip_batches.json").read_text()) == [SPIKE]


STOP_CONFIG = {
    "wg_distribution": True,
    "format": ["csv"],
    "replica_check": {"enable": True, "every": 1},
    "alert": {"dump": True, "actions": [{"on": ["verdict:one_rank_model_copy"], "do": "stop"}]},
}


@pytest.fixture(scope="module")
def stops(tmp_path_factory):
    out = tmp_path_factory.mktemp("stop") / "out"
    args = ["--steps", "12", "--flip-rank", "1", "--flip-step", str(FLIP)]
    first = msmon_run(STOP_CONFIG, out, *args)
    ledger_after_first = (out / "incidents.jsonl").read_text() if (out / "incidents.jsonl").exists() else ""
    second = msmon_run(STOP_CONFIG, out, *args)
    return first, second, out, ledger_after_first


def test_a_replica_fault_with_stop_on_one_rank_model_copy_makes_msmon_run_exit_16(stops):
    first, _, _, ledger = stops
    assert first.returncode == 16, first.stdout[-2000:] + first.stderr[-4000:]
    (incident,) = [json.loads(line) for line in ledger.splitlines()]
    assert (incident["step"], incident["verdict"], incident["code"]) == (FLIP, "one_rank_model_copy", 16)
    assert incident["hosts"] and incident["ranks"]
    lines = [line for line in (first.stdout + first.stderr).splitlines() if "as alert.actions[0] asks" in line]
    assert lines == [
        f"msmon: the job stopped after step {FLIP + 1} as alert.actions[0] asks (exit code 16: restart it elsewhere): "
        f"one rank's copy of the model (step {FLIP}, first module fc1) [verdict one_rank_model_copy]"
    ]
    assert "exitcode" not in first.stderr  # torchrun's failure report left out: a decision, not a crash
    for rank in (0, 1):
        finished = [int(s) for s in re.findall(rf"rank {rank} finished step (\d+)", first.stdout)]
        assert finished == list(range(FLIP + 1)), rank  # the step after the fault's trained, then the stop


def test_the_same_fault_at_the_same_step_after_a_restart_exits_17_with_the_ledger_s_reason(stops):
    _, second, out, _ = stops
    assert second.returncode == 17, second.stdout[-2000:] + second.stderr[-4000:]
    lines = [line for line in (second.stdout + second.stderr).splitlines() if "as alert.actions[0] asks" in line]
    assert len(lines) == 1 and "(exit code 17: do not restart it blindly)" in lines[0]
    assert f"the same fault (one_rank_model_copy at step {FLIP}) is in the incident ledger 1 time already" in lines[0]
    incidents = [json.loads(line) for line in (out / "incidents.jsonl").read_text().splitlines()]
    assert [(i["step"], i["code"]) for i in incidents] == [(FLIP, 16), (FLIP, 17)]


def test_a_rank_killed_while_the_others_vote_ends_the_job_at_once_with_one_clear_line(tmp_path):
    config = {
        "wg_distribution": True,
        "format": ["csv"],
        "alert": {
            "rules": [TURBULENCE],
            "actions": [{"on": ["AnomalyTurbulence"], "do": "notify", "command": ["true"]}],
        },
    }  # the vote waits 600 s by default: only the closed connection of a dead rank ends it this soon
    started = time.monotonic()
    proc = msmon_run(
        config, tmp_path / "out", "--steps", "12", "--kill-rank", "1", "--kill-step", str(KILL), timeout=180
    )
    took = time.monotonic() - started
    assert proc.returncode != 0 and f"rank 1 leaves at step {KILL}" in proc.stdout
    assert took < 90, took
    said = [line for line in proc.stderr.splitlines() if line.startswith("msmon[rank 0]: the vote")]
    assert len(said) == 1, proc.stderr[-4000:]
    assert re.match(
        rf"msmon\[rank 0\]: the vote after step {KILL} lost a rank after \d+\.\d s \(its connection closed: it died "
        r"or left\) .*; alert.actions and on_nan are off on this rank, training goes on$",
        said[0],
    ), said[0]


def chromium_dom(page: Path, profile: Path, script: str) -> str:
    """The page's DOM after its own scripts and `script` ran, in headless Chromium."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.fail("headless Chromium is needed for this test and was not found: apt-get install -y chromium")
    copy = page.with_name("scripted.html")
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", f"<script>{script}</script></body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000"]  # fmt: skip
    shown = subprocess.run([browser, *flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in shown.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "the page wrote to the console:\n" + "\n".join(console)
    return shown.stdout


READ_THE_BAND = """
  var cv = document.querySelector("#heat-grad_reduced .heat canvas"), box = cv.getBoundingClientRect();
  cv.dispatchEvent(new MouseEvent("click", { clientX: box.left + 300, clientY: box.top + 20 + 7, bubbles: true }));
  var chart = document.querySelector(".row-chart canvas"), ctx = chart.getContext("2d");
  var span = chart.getAttribute("data-span-px").split("-").map(Number), mid = Math.round((span[0] + span[1]) / 2);
  var strip = ctx.getImageData(0, 18, chart.width, 1).data;  /* one read: a row of pixels across the plot */
  function rgb(x) { return [strip[4 * x], strip[4 * x + 1], strip[4 * x + 2]].join(" "); }
  document.body.setAttribute("data-band-pixel", rgb(mid));
  document.body.setAttribute("data-plain-pixel", rgb(span[0] - 30));
"""


@pytest.mark.browser
def test_the_database_keeps_the_escalated_steps_and_the_report_draws_them_as_a_band(escalation, tmp_path):
    import duckdb

    from msmon.offline.results import report_html

    database = tmp_path / "run.duckdb"
    loaded = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "db", "-d", str(escalation["out"]), "-o", str(database)],
        capture_output=True, text=True, timeout=300, env=env(),
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    con = duckdb.connect(str(database), read_only=True)
    rows = con.execute(
        "SELECT rank, action, first_step, last_step, alert_step, keys FROM actions ORDER BY rank"
    ).fetchall()
    assert rows == [(rank, "escalate", BAD + 2, BAD + 4, BAD, "all_xy") for rank in (0, 1)]
    activations = con.execute(  # the escalated steps, joined with the statistics: the activations are there only
        "SELECT DISTINCT m.step, m.step BETWEEN a.first_step AND a.last_step FROM metrics m JOIN actions a "
        "ON m.rank = a.rank WHERE m.category = 'actv' ORDER BY 1"
    ).fetchall()
    assert activations == [(step, True) for step in range(BAD + 2, BAD + 5)]
    page = tmp_path / "report.html"
    report_html.build(con, str(page), str(database))
    con.close()
    dom = chromium_dom(page, tmp_path / "profile", READ_THE_BAND)
    assert f'<li data-action="escalate" data-steps="{BAD + 2}-{BAD + 4}">steps {BAD + 2}–{BAD + 4} escalated' in dom
    assert f'data-spans="escalate:{BAD + 2}-{BAD + 4}"' in dom  # the clicked row's chart over steps
    band = re.search(r'data-band-pixel="(\d+) (\d+) (\d+)"', dom)
    plain = re.search(r'data-plain-pixel="(\d+) (\d+) (\d+)"', dom)
    assert plain is not None and plain.groups() == ("255", "255", "255"), dom[-2000:]  # white outside the band
    assert band is not None and int(band[1]) > int(band[3]) + 40  # amber inside it


def test_skip_step_under_deepspeed_zero2_leaves_its_own_fp32_weights_and_moments_as_they_were(tmp_path):
    config = {
        "wg_distribution": True,
        "format": ["csv"],
        "ops": ["norm", "max"],
        "alert": {
            "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 30}}],
            "actions": [{"on": ["AnomalyTurbulence"], "do": "skip_step"}],
        },
    }
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(tmp_path / "c.json")]
    (tmp_path / "c.json").write_text(json.dumps(config))
    proc = run_job(
        [*argv, "--output-dir", str(tmp_path / "out"), "--standalone", "--nproc-per-node", "2", "--",
         str(ROOT / "tests" / "scripts" / "ds_skip.py"), "--stage", "2", "--steps", "8", "--spike-step", "5"],
        timeout=600, env=env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    # DeepSpeed's own full fp32 weights and Adam moments after each step (two ranks' prints may share a line)
    after = {(int(r), int(s)): h for r, s, h in re.findall(r"rank (\d) step (\d+) ([0-9a-f]{64})", proc.stdout)}
    for rank in (0, 1):
        steps = [after[(rank, s)] for s in range(8)]
        assert steps[5] == steps[4] and len(set(steps)) == 7, rank
        assert summary(tmp_path / "out", rank)["skips"] == 1
