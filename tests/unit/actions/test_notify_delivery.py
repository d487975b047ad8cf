"""notify's delivery (output/notify.py, runtime/actions/notify.py) against a real HTTP server on
127.0.0.1 and a real command: one message per rule and tensor, a Slack-compatible `text`, the
alert in MSMON_ALERT_* variables, bounded retries, and a slow endpoint that never holds the
caller back."""

from __future__ import annotations

import json
import sys
import time

import pytest

from local_endpoint import Endpoint
from msmon.anomaly.seen import Seen
from msmon.config import parse_config
from msmon.output import notify
from msmon.output.notify import Notifier, Target
from msmon.runtime.actions.decide import triggers, views
from msmon.runtime.actions.notify import Notifications


@pytest.fixture
def endpoint():
    server = Endpoint()
    yield server
    server.close()


def alert(rank: int, step: int, name: str, rule: str = "AnomalyNan") -> Seen:
    return Seen(
        rank, step, rule, "grad_reduced", name, "optimizer", None, 3, message="1 NaN value", op="nans", value=1.0
    )


def notify_action(**keys):
    rules = [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 2}}]
    (action,) = parse_config(
        {"alert": {"rules": rules, "actions": [{"on": ["AnomalyNan", "AnomalyTurbulence"], "do": "notify", **keys}]}}
    ).alert.actions
    return action


def test_one_post_per_rule_and_tensor_across_ranks_and_steps_with_a_slack_text(endpoint):
    action = notify_action(url=endpoint.url)
    notifications = Notifications(rank=0, speaker=True)
    steps = [
        [alert(0, 4, "fc1.weight"), alert(1, 4, "fc1.weight"), alert(1, 4, "fc2.weight")],
        [alert(0, 5, "fc1.weight"), alert(1, 5, "fc2.weight"), alert(1, 5, "fc2.weight", "AnomalyTurbulence")],
    ]
    for step in steps:
        for trigger in triggers([action], views(step, [0, 1])[0]):
            notifications.consider(trigger)
    notifications.close(seconds=20.0)
    got = sorted((b["rule"], b["tensor"], b["step"], tuple(b["ranks"])) for b in endpoint.bodies)
    assert got == [
        ("AnomalyNan", "fc1.weight", 4, (0, 1)),
        ("AnomalyNan", "fc2.weight", 4, (1,)),
        ("AnomalyTurbulence", "fc2.weight", 5, (1,)),
    ]
    first = next(b for b in endpoint.bodies if b["tensor"] == "fc1.weight")
    assert first["text"] == (
        "msmon alert at step 4: AnomalyNan on the reduced gradient of fc1.weight on ranks 0, 1: 1 NaN value"
    )
    assert notifications.delivery is not None and notifications.delivery.sent == 3


def test_a_rank_that_does_not_speak_for_the_job_sends_nothing(endpoint):
    notifications = Notifications(rank=1, speaker=False)
    for trigger in triggers([notify_action(url=endpoint.url)], views([alert(1, 4, "fc1.weight")], [0, 1])[0]):
        notifications.consider(trigger)
    notifications.close()
    assert endpoint.bodies == [] and notifications.delivery is None


def test_a_failing_endpoint_is_retried_a_bounded_number_of_times_and_counted(monkeypatch):
    monkeypatch.setattr(notify, "BACKOFF_SECONDS", 0.01)
    failing = Endpoint(status=503)
    try:
        notifier = Notifier(rank=0)
        notifier.send(Target(url=failing.url, timeout=2.0, retries=2), {"text": "x"})
        delivery = notifier.close(seconds=10.0)
        assert len(failing.bodies) == 3  # the first attempt and two retries
        assert (delivery.sent, delivery.failed) == (0, 1) and "HTTP 503" in delivery.errors[0]
    finally:
        failing.close()


def test_an_endpoint_that_sleeps_10_s_holds_neither_the_sender_nor_the_close_past_half_a_second():
    slow = Endpoint(delay=10.0)
    try:
        notifier = Notifier(rank=0)
        started = time.monotonic()
        for i in range(3):
            notifier.send(Target(url=slow.url, timeout=5.0, retries=1), {"text": f"alert {i}"})
        queued = time.monotonic() - started
        delivery = notifier.close()
        closed = time.monotonic() - started
        assert queued < 0.1 and closed < 1.0
        assert slow.finished == 0 and delivery.dropped == 3 and delivery.close_seconds < 1.0
    finally:
        slow.close()


def test_a_command_gets_the_alert_in_its_environment(tmp_path):
    out = tmp_path / "env.json"
    script = (
        "import json, os; "
        f"json.dump({{k: v for k, v in os.environ.items() if k.startswith('MSMON_ALERT_')}}, open({str(out)!r}, 'w'))"
    )
    notifications = Notifications(rank=0, speaker=True)
    action = notify_action(command=[sys.executable, "-c", script])
    for trigger in triggers([action], views([alert(1, 7, "fc2.weight")], [0, 1])[0]):
        notifications.consider(trigger)
    notifications.close(seconds=20.0)
    assert notifications.delivery is not None and notifications.delivery.sent == 1
    env = json.loads(out.read_text())
    assert (env["MSMON_ALERT_RULE"], env["MSMON_ALERT_STEP"], env["MSMON_ALERT_RANKS"]) == ("AnomalyNan", "7", "1")
    assert env["MSMON_ALERT_TENSOR"] == "fc2.weight" and env["MSMON_ALERT_TEXT"].startswith("msmon alert at step 7")
    assert json.loads(env["MSMON_ALERT_JSON"])["category"] == "grad_reduced"
