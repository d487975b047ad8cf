"""The trackers' verdict without torchrun: each rank's alerts heard where alert.actions' vote
hears them (a real ActionBoard, inert as with no action configured), kept and encoded as they
travel with the lanes, combined on the logging rank: the kind equals what `msmon analyse`'s
function tells from every alert posted (offline/analyse/kind.py over the same records), the
later steps' alerts do not travel, and the kind is announced when told and when it changes.
The announcements reach a real MLflow run (local file store) as tags; W&B's alerts are read
back from a real offline run in tests/e2e/test_trackers_e2e.py, with the gather of 2 ranks."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from msmon.anomaly.data_path import PathEvent
from msmon.anomaly.event import NAN_ORIGIN_RULE, REPLICA_RULE
from msmon.anomaly.fault_kind import KINDS, classify
from msmon.anomaly.seen import Seen
from msmon.collectors.trackers.collector import TrackerState, close_runs, escalated
from msmon.collectors.trackers.lanes import ALERT_BYTES, LaneCombiner, LaneReader
from msmon.collectors.trackers.verdict import FirstAnomaly, RankAlerts, decode
from msmon.config import parse_config
from msmon.offline.analyse.events import AnomalyEvent
from msmon.offline.analyse.kind import fault_kind
from msmon.output.category_ops import CategoryColumns
from msmon.output.sinks.tracker import StepLanes
from msmon.records.rows import RowKey, StepRecord
from msmon.runtime.actions.board import MAX_SEEN_PER_STEP, ActionBoard
from msmon.runtime.actions.decide import triggers, views
from msmon.runtime.actions.escalate import Escalation

NAN = "AnomalyNan"
OPS = ["norm"]
KEYS = [RowKey("grad_reduced", "fc1.weight"), RowKey("actv", "fc1.output", micro_step=0)]


def seen(rank: int, step: int, category: str, name: str, rule: str = NAN, micro=None, call: int = 0) -> Seen:
    return Seen(rank, step, rule, category, name, "", micro, call, message="norm=nan")


def nan_made_by_rank1s_fc2(step: int) -> dict[int, list[Seen]]:
    """What each rank's writer posts at a step where rank 1's fc2 made a NaN (the all-reduce
    brought it to rank 0's reduced gradient and weights)."""
    return {
        1: [
            seen(1, step, "actv", "fc2.output", NAN_ORIGIN_RULE, micro=0, call=3),
            seen(1, step, "actv", "fc2.output", micro=0, call=3),
            seen(1, step, "actv_grad", "fc2.input_grad", micro=0, call=5),
            seen(1, step, "grad_unreduced", "fc2.weight", call=9),
            seen(1, step, "grad_reduced", "fc2.weight", call=12),
        ],
        0: [
            seen(0, step, "grad_reduced", "fc2.weight", call=12),
            seen(0, step, "param_updated", "fc2.weight", call=20),
        ],
    }


def analysed(posted: list[Seen]):
    """What `msmon analyse` tells from the dump's records of the same alerts (every one posted)."""
    records = [AnomalyEvent(**{**vars(s.path_event()), "op": "norm", "value": float("nan")}) for s in posted]
    return fault_kind(records, {0, 1})


class Ranks:
    """Two ranks' boards and kept alerts, and the logging rank's combiner."""

    def __init__(self) -> None:
        self.boards = {rank: ActionBoard() for rank in (0, 1)}  # inert: no action configured
        self.heard = {rank: RankAlerts() for rank in (0, 1)}
        for rank in (0, 1):
            self.boards[rank].listen(self.heard[rank].hear)
        self.combiner = LaneCombiner([0, 1])
        self.posted: list[Seen] = []
        self.sent: dict[int, bytes] = {}

    def post(self, by_rank: dict[int, list[Seen]], thread: bool = False) -> None:
        for rank, alerts in by_rank.items():
            if thread:  # as the replica check's exchange thread posts
                poster = threading.Thread(target=self.boards[rank].saw, args=(iter(alerts),))
                poster.start()
                poster.join()
            else:
                self.boards[rank].saw(alerts)
            self.posted += alerts

    def lanes(self, step: int) -> StepLanes:
        """The step's lanes as the logging rank makes them (the gather stacks the same payloads)."""
        payloads, names = [], []
        for rank in (0, 1):
            told = self.heard[rank].take()
            record = StepRecord(step, rank, OPS, KEYS, table=torch.ones(len(KEYS), len(OPS), dtype=torch.float64))
            mine = LaneReader(CategoryColumns({}), [], explicit=False).read(record, 1.0, 0, told)
            assert mine.payload[ALERT_BYTES] == len(told)
            payloads.append(mine.payload)
            names.append(mine.names)
            self.sent[rank] = told
        events = [e for rank in (0, 1) for e in decode(self.sent[rank])]
        return self.combiner.combine(torch.stack(payloads), names, {}, events)


def test_the_verdict_is_the_kind_msmon_analyse_tells_from_every_ranks_alerts_and_changes_with_a_replica_check():
    ranks = Ranks()
    assert ranks.lanes(2).verdict == "ok" and ranks.sent == {0: b"", 1: b""}

    ranks.post(nan_made_by_rank1s_fc2(3))
    lanes = ranks.lanes(3)
    offline = analysed(ranks.posted)
    assert offline is not None and offline.code == "one_rank_data_or_device"
    assert lanes.told and lanes.kind == offline  # code, rank, module, tensor, why: all alike
    assert (lanes.kind.rank, lanes.kind.module) == (1, "fc2")
    assert lanes.verdict == "one_rank_data_or_device" and lanes.level == "ok"  # no lane value of this table is NaN
    assert lanes.values["msmon/verdict_text"] == f"one_rank_data_or_device: {offline.headline()}"

    # after the NaN every step alerts on both ranks: kept out of the gather, the kind holds
    ranks.post({0: [seen(0, 4, "actv", "fc1.input", micro=0, call=1)], 1: [seen(1, 4, "actv", "fc1.input", call=1)]})
    lanes = ranks.lanes(4)
    assert ranks.sent == {0: b"", 1: b""}
    assert not lanes.told and lanes.kind == analysed(ranks.posted) == offline
    assert lanes.verdict == "one_rank_data_or_device"

    # the replica check names rank 1 two steps later (its own thread): the rank's copy of the model
    ranks.post({1: [seen(1, 5, "param_origin", "fc2.weight", REPLICA_RULE, call=0)]}, thread=True)
    lanes = ranks.lanes(5)
    changed = analysed(ranks.posted)
    assert changed is not None and changed.code == "one_rank_model_copy"
    assert lanes.told and lanes.kind == changed and lanes.verdict == "one_rank_model_copy"
    assert not ranks.lanes(6).told  # told once per change


def test_a_rank_alerting_on_every_tensor_sends_a_bounded_few_and_the_kind_is_still_analyses():
    ranks = Ranks()
    flood = [seen(0, 7, "actv", f"layers.{i}.output", micro=0, call=10 + i) for i in range(1000)]
    flood.append(seen(0, 7, "actv", "layers.999.output", NAN_ORIGIN_RULE, micro=0, call=1009))
    ranks.post({0: flood, 1: [seen(1, 7, "grad_reduced", "layers.0.weight", call=2000)]})
    lanes = ranks.lanes(7)
    assert len(decode(ranks.sent[0])) == MAX_SEEN_PER_STEP + 1  # the first in training order, and the origin
    assert lanes.kind == analysed(ranks.posted) and lanes.kind is not None
    assert lanes.kind.code == "one_rank_data_or_device" and lanes.kind.module == "layers.999"


CATEGORIES = ["actv", "actv_grad", "loss", "grad_unreduced", "grad_reduced", "exp_avg", "param_origin"]


def test_what_the_ranks_keep_and_send_tells_the_kind_classify_tells_from_every_alert_whatever_the_order():
    rng = random.Random(44)
    told = 0
    for trial in range(300):
        ranks = list(range(rng.choice([2, 3, 4])))
        posted = []
        for call in range(rng.randint(1, 14)):
            rule = rng.choice([NAN, NAN, NAN_ORIGIN_RULE, REPLICA_RULE, "AnomalyRankOutlier"])
            category = "param_origin" if rule == REPLICA_RULE else rng.choice(CATEGORIES)
            micro = 0 if category in ("actv", "actv_grad") else None
            posted.append(seen(rng.choice(ranks), rng.randint(1, 4), category, f"m{call % 3}.x", rule, micro, call))
        rng.shuffle(posted)  # the rank-outlier and replica threads post late, in any order
        kept = {rank: RankAlerts() for rank in ranks}
        combined = FirstAnomaly(ranks)
        for one in posted:
            kept[one.rank].hear([one])
            if rng.random() < 0.4:  # a recorded step: what each rank kept so far travels
                combined.add(e for rank in ranks for e in decode(kept[rank].take()))
        combined.add(e for rank in ranks for e in decode(kept[rank].take()))
        expected = classify([s.path_event() for s in posted], ranks)
        assert combined.kind() == expected, trial
        told += expected is not None
    assert told > 200  # most trials tell a kind: the comparison is not vacuous


def test_an_escalation_of_alert_actions_reaches_the_trackers_with_its_steps_and_why():
    config = parse_config({"alert": {"rules": [{"rule_name": NAN}], "actions": []}})
    action = parse_config(
        {
            "alert": {
                "rules": [{"rule_name": NAN}],
                "actions": [{"on": [NAN], "do": "escalate", "for_steps": 2, "config": {"all_xy": True}}],
            }
        }
    ).alert.actions[0]
    escalation = Escalation(speaker=False)
    alerts = [s for by_rank in nan_made_by_rank1s_fc2(5).values() for s in by_rank]
    trigger = triggers([action], views(alerts, [0, 1])[0])[0]
    escalation.consider(trigger)
    escalation.at_boundary(7, config, None)
    (one,) = escalated(escalation.records, 0)
    assert (one.number, one.first_step, one.last_step, one.alert_step, one.keys) == (1, 7, 8, 5, ("all_xy",))
    assert one.why == trigger.why() and one.title() == "msmon: escalation of steps 7 to 8"
    assert escalated(escalation.records, 1) == []


@pytest.fixture
def mlflow_run(tmp_path, monkeypatch):
    """A real MLflow run on a local file store, as msmon's MlflowRun logs into it; its client."""
    import mlflow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
    from mlflow import MlflowClient

    from msmon.output.sinks.mlflow_sink import MlflowRun

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    return MlflowRun(client, run_id, own=True, max_keys=100), client


def escalate_on_nan(first_step: int, alerts: list[Seen]) -> list[dict]:
    """The records of an escalation of alert.actions decided on `alerts`, starting at `first_step`."""
    action = parse_config(
        {
            "alert": {
                "rules": [{"rule_name": NAN}],
                "actions": [{"on": [NAN], "do": "escalate", "for_steps": 1, "config": {"all_xy": True}}],
            }
        }
    ).alert.actions[0]
    escalation = Escalation(speaker=False)
    escalation.consider(triggers([action], views(alerts, [0, 1])[0])[0])
    escalation.at_boundary(first_step, parse_config({}), None)
    return escalation.records


def test_the_kind_its_level_and_an_escalation_are_mlflow_tags(mlflow_run):
    run, client = mlflow_run
    run_id = run.run_id
    ranks = Ranks()
    ranks.post(nan_made_by_rank1s_fc2(3))
    lanes = ranks.lanes(3)
    lanes.rise = "non-finite: actv norm nan on rank 1 (0:fc2.output:0)"
    lanes.level = "nonfinite"
    lanes.escalations = escalated(escalate_on_nan(5, ranks.posted), 0)
    run.send(lanes)
    run.close()
    tags = client.get_run(run_id).data.tags
    kind = lanes.kind
    assert kind is not None
    assert tags["msmon.verdict"] == "one_rank_data_or_device" == kind.code
    assert (tags["msmon.verdict.rank"], tags["msmon.verdict.module"], tags["msmon.verdict.step"]) == ("1", "fc2", "3")
    assert tags["msmon.verdict.action"] == KINDS[kind.code].action and tags["msmon.verdict.why"] == kind.why
    assert tags["msmon.first_nonfinite"] == f"step 3: {lanes.rise}"
    assert tags["msmon.escalation.1"].startswith(
        "steps 5 to 5 record also all_xy (alert.actions[0], on the alerts of step 3): "
    )
    assert tags["msmon/verdict_text"] == f"one_rank_data_or_device: {kind.headline()}"


def test_an_escalation_that_starts_after_the_last_lanes_is_announced_when_the_job_ends(mlflow_run):
    run, client = mlflow_run
    records = escalate_on_nan(9, [s for by_rank in nan_made_by_rank1s_fc2(7).values() for s in by_rank])
    state = TrackerState(parse_config({}), [], runs={"mlflow": run})
    close_runs(state, 0, lambda: records)  # none went with a step's lanes
    stored = client.get_run(run.run_id)
    assert stored.data.tags["msmon.escalation.1"].startswith("steps 9 to 9 record also all_xy (alert.actions[0]")
    assert stored.info.status == "FINISHED"


def test_an_alert_travels_as_the_same_path_event_with_every_field():
    events = [PathEvent(1, 3, "actv", "fc2.output", NAN_ORIGIN_RULE, 0, 3, "forward", 2, 1), PathEvent(0, 3, "x", "y")]
    ranks = RankAlerts()
    ranks.hear([Seen(e.rank, e.step, e.rule, e.category, e.name, e.stage, e.micro_step, e.call_id, e.vpp_stage,
                     e.pp_stage) for e in events])  # fmt: skip
    assert sorted(decode(ranks.take()), key=PathEvent.position) == sorted(events, key=PathEvent.position)
