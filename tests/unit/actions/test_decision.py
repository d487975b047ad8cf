"""The pieces of the per-step decision that need no second rank: what a rank's readers saw and
when they finished (board.py), the triggers every rank computes alike from every rank's alerts
(decide.py, with anomaly/fault_kind.py's classify, as `msmon analyse` reads the dump), the exit
code a stop takes from the kind (stop.py), the incident ledger and when an escalation starts."""

from __future__ import annotations

import pickle
import threading
import time

from msmon.anomaly.seen import Seen, from_record
from msmon.config import parse_config
from msmon.offline.analyse.events import AnomalyEvent
from msmon.offline.analyse.kind import fault_kind
from msmon.records.incidents import append_incident, occurrences, read_incidents
from msmon.runtime.actions.board import WRITER, ActionBoard
from msmon.runtime.actions.decide import triggers, views
from msmon.runtime.actions.escalate import Escalation
from msmon.runtime.actions.stop import JOB_FAULT_STOP, RANK_FAULT_STOP, code_for

NAN, TURBULENCE = "AnomalyNan", "AnomalyTurbulence"


def seen(rank, step, category, name, rule=NAN, micro=None, call=0, stage="", host="") -> Seen:
    return Seen(rank, step, rule, category, name, stage, micro, call, host=host, message="norm=nan")


def actions(*entries: dict) -> list:
    rules = [{"rule_name": NAN}, {"rule_name": TURBULENCE, "args": {"threshold": 2}}]
    return parse_config({"alert": {"rules": rules, "actions": list(entries)}}).alert.actions


def rank1_made_a_nan(step: int = 5) -> list[Seen]:
    """A DDP step in which rank 1's fc2 made a NaN: its forward and own gradient, and the reduced
    gradient of both ranks (the all-reduce brought it to rank 0)."""
    return [
        seen(1, step, "actv", "fc2.output", micro=0, call=3),
        seen(1, step, "grad_unreduced", "fc2.weight", call=9),
        seen(1, step, "grad_reduced", "fc2.weight", call=12),
        seen(0, step, "grad_reduced", "fc2.weight", call=12),
    ]


def test_the_vote_waits_for_every_reader_of_the_step_and_stops_waiting_for_a_retired_one():
    board = ActionBoard(active=True)
    board.expect(WRITER, 3)
    board.expect("replica_check", 3)
    board.expect(WRITER, 4)  # a later step does not hold step 3 back
    assert board.wait_finished(3, 0.05) == ["replica_check", "writer"]

    def finish() -> None:
        time.sleep(0.05)
        board.saw([seen(0, 3, "grad_reduced", "fc1.weight")])
        board.done(WRITER, 3)
        board.retire("replica_check")  # its exchange failed: nothing more to wait for

    threading.Thread(target=finish).start()
    assert board.wait_finished(3, 5.0) == []
    assert [s.name for s in board.take(3)] == ["fc1.weight"] and board.take(3) == []
    board.expect("replica_check", 5)  # a retired reader is never waited for again
    assert board.wait_finished(5, 0.0) == ["writer"]


def test_an_inert_board_costs_nothing_and_holds_nothing():
    board = ActionBoard()
    board.expect(WRITER, 1)
    board.saw([seen(0, 1, "actv", "x.output")])
    assert board.wait_finished(1, 10.0) == [] and board.take(1) == []


def test_a_verdict_trigger_is_the_kind_msmon_analyse_tells_from_the_same_alerts():
    alerts = rank1_made_a_nan()
    (view,) = views(pickle.loads(pickle.dumps(alerts)), [0, 1])  # as the vote carries them
    records = [AnomalyEvent(**{**vars(s.path_event()), "op": "norm", "value": 0.0}) for s in alerts]
    offline = fault_kind(records, {0, 1})
    assert view.kind is not None and offline is not None and view.kind.code == offline.code == "one_rank_data_or_device"
    stop, escalate = actions(
        {"on": ["verdict:one_rank_data_or_device"], "do": "stop"},
        {"on": ["verdict:all_ranks", TURBULENCE], "do": "escalate", "for_steps": 2, "config": {"all_xy": True}},
    )
    (trigger,) = triggers([stop, escalate], view)
    assert (trigger.index, trigger.verdict, trigger.ranks) == (0, True, [1])
    assert code_for(trigger)[0] == RANK_FAULT_STOP


def test_a_rule_trigger_lists_its_alerts_in_training_order_and_a_stop_without_a_kind_is_not_a_restart():
    alerts = [seen(0, 2, "grad_reduced", "fc1.weight", call=4), seen(0, 2, "actv", "fc1.output", micro=0, call=1)]
    (view,) = views(alerts, [0])  # one rank: no kind is told
    (trigger,) = triggers(actions({"on": [NAN], "do": "stop"}), view)
    assert [s.category for s in trigger.matched] == ["actv", "grad_reduced"] and not trigger.verdict
    assert "on the forward output of fc1 on rank 0" in trigger.why() and "1 more alert" in trigger.why()
    assert code_for(trigger)[0] == JOB_FAULT_STOP


def test_every_rank_together_and_one_rank_s_data_are_not_restarted_elsewhere_but_some_ranks_on_one_host_are():
    everyone = [seen(r, 4, "actv", "fc1.input", micro=0, call=0, host=f"node{r}") for r in (0, 1, 2)]
    (trigger,) = triggers(actions({"on": ["verdict:all_ranks"], "do": "stop"}), views(everyone, [0, 1, 2])[0])
    assert code_for(trigger)[0] == JOB_FAULT_STOP
    two = [seen(r, 4, "actv", "fc1.output", micro=0, call=1, host="node7") for r in (1, 2)]
    (trigger,) = triggers(actions({"on": ["verdict:some_ranks"], "do": "stop"}), views(two, [0, 1, 2])[0])
    code, words = code_for(trigger)
    assert code == RANK_FAULT_STOP and "all on host node7" in words
    apart = [
        seen(1, 4, "actv", "fc1.output", micro=0, call=1, host="a"),
        seen(2, 4, "actv", "fc1.output", micro=0, call=1, host="b"),
    ]
    (trigger,) = triggers(actions({"on": ["verdict:some_ranks"], "do": "stop"}), views(apart, [0, 1, 2])[0])
    assert code_for(trigger)[0] == JOB_FAULT_STOP


def test_a_replica_check_record_travels_as_the_dump_writes_it_and_names_the_copy():
    record = {
        "rank": 1, "step": 8, "micro_step": None, "vpp_stage": 0, "stage": "optimizer", "call_id": 1 << 30,
        "name": "fc1.weight", "category": "param_updated", "op": "replica_mismatch", "value": 2.0,
        "rule": "ReplicaMismatch", "message": "replica check: fc1.weight differs",
    }  # fmt: skip
    (view,) = views([from_record(record), from_record({**record, "rank": 0})], [0, 1])
    assert view.kind is not None and view.kind.code == "one_rank_model_copy"


def test_an_escalation_starts_once_per_new_alert_and_not_while_one_is_in_force():
    base = parse_config({"wg_distribution": True, "alert": {"rules": [{"rule_name": NAN}]}})
    (action,) = actions({"on": [NAN], "do": "escalate", "for_steps": 2, "config": {"all_xy": True}})
    escalation = Escalation(speaker=False)
    step5 = triggers([action], views(rank1_made_a_nan(5), [0, 1])[0])[0]
    escalation.consider(step5)
    up = escalation.at_boundary(7, base, None)
    assert up is not None and up.all_xy and not base.all_xy
    escalation.consider(triggers([action], views(rank1_made_a_nan(6), [0, 1])[0])[0])  # the same tensors again
    assert escalation.at_boundary(8, up, None) is None
    back = escalation.at_boundary(9, up, None)
    assert back is base
    escalation.consider(triggers([action], views(rank1_made_a_nan(9), [0, 1])[0])[0])  # repeats: no new one
    assert escalation.at_boundary(10, base, None) is None
    assert escalation.summary(20) == [
        {"first_step": 7, "last_step": 8, "action": 0, "alert_step": 5, "why": step5.why(), "keys": ["all_xy"]}
    ]
    assert escalation.summary(7)[0]["last_step"] == 7 and escalation.summary(7)[0]["cut_short"]


def test_the_ledger_counts_the_same_verdict_at_the_same_step_and_skips_a_torn_line(tmp_path):
    assert read_incidents(str(tmp_path)) == []
    append_incident(str(tmp_path), {"step": 8, "verdict": "one_rank_model_copy", "code": 16})
    with open(tmp_path / "incidents.jsonl", "a") as fh:
        fh.write('{"step": 8, "verdict": "one_rank_mo')  # a crash mid-write
    append_incident(str(tmp_path), {"step": 9, "verdict": "one_rank_model_copy", "code": 16})
    incidents = read_incidents(str(tmp_path))
    assert [r["step"] for r in incidents] == [8, 9]  # the next record starts on a line of its own
    assert (tmp_path / "incidents.jsonl").read_text().count("\n") == 3
    assert occurrences(incidents, "one_rank_model_copy", 8) == 1 and occurrences(incidents, "all_ranks", 8) == 0
