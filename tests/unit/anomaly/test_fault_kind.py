"""The kind of fault follows the data path (anomaly/fault_kind.py): which rank's own, rank-local
values turned first at the first anomalous step, not how many ranks have an anomaly there. The
events are those a DDP job's dump holds (the same records the end-to-end tests read from real
torchrun ranks: tests/e2e/test_fault_kinds.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from msmon.anomaly.data_path import PathEvent
from msmon.anomaly.fault_kind import KINDS, classify
from msmon.offline.analyse.events import AnomalyEvent
from msmon.offline.analyse.kind import fault_kind
from msmon.offline.analyse.verdict import order_events, verdict

ROOT = Path(__file__).resolve().parents[3]
NAN, ORIGIN, OUTLIER, TURBULENCE, REPLICA = (
    "AnomalyNan",
    "NanOrigin",
    "AnomalyRankOutlier",
    "AnomalyTurbulence",
    "ReplicaMismatch",
)


def ev(rank, step, category, name, rule=NAN, micro=None, call=0, stage=""):
    return PathEvent(rank, step, category, name, rule, micro, call, stage)


def nan_made_by(rank: int, module: str, ranks: int = 2, step: int = 5) -> list[PathEvent]:
    """What the dump of a DDP job holds when `module`'s forward output turns NaN on `rank` alone:
    that rank's forward, backward and own gradient; every other rank's reduced gradient (the
    all-reduce brought it) and weights; then, a step later, everything on every rank."""
    events = [
        ev(rank, step, "actv", f"{module}.output", ORIGIN, 0, 3),
        ev(rank, step, "actv", f"{module}.output", NAN, 0, 3),
        ev(rank, step, "actv", "head.output", NAN, 0, 5),
        ev(rank, step, "actv_grad", "loss", NAN, 0, 7),
        ev(rank, step, "actv_grad", f"{module}.input_grad", NAN, 0, 9),
        ev(rank, step, "grad_unreduced", f"{module}.weight", NAN, None, 12),
        ev(rank, step, "grad_reduced", f"{module}.weight", NAN, None, 20),
        ev(rank, step, "param_updated", f"{module}.weight", NAN, None, 30),
    ]
    for other in range(ranks):
        if other != rank:
            events += [
                ev(other, step, "grad_reduced", "fc1.weight", ORIGIN, None, 19),
                ev(other, step, "grad_reduced", "fc1.weight", NAN, None, 19),
                ev(other, step, "param_updated", "fc1.weight", NAN, None, 29),
            ]
    for r in range(ranks):  # the next step: NaN everywhere, on every rank
        events += [ev(r, step + 1, "actv", "fc1.output", NAN, 0, 1), ev(r, step + 1, "actv", "fc1.input", NAN, 0, 0)]
    return events


def test_a_nan_made_by_one_layer_on_one_rank_that_reaches_the_other_through_the_all_reduce_is_that_ranks():
    kind = classify(nan_made_by(1, "blocks.0.fc2"), {0, 1})
    assert kind is not None
    assert (kind.code, kind.rank, kind.step, kind.module) == ("one_rank_data_or_device", 1, 5, "blocks.0.fc2")
    assert kind.tensor == "forward output of blocks.0.fc2"
    assert kind.why.startswith("rank 1: its data or its device; rank-local values turned first, on rank 1 only")
    assert "rank 0 turned only after the reduction (reduced gradient of fc1.weight)" in kind.why
    assert kind.kind == "one rank: its data or its device"
    # every rank has an anomaly at step 5: counting ranks called this "all ranks together"
    assert {e.rank for e in nan_made_by(1, "blocks.0.fc2") if e.step == 5} == {0, 1}


def test_the_same_one_rank_fault_among_four_ranks_and_on_rank_zero_is_told_alike():
    for rank in (0, 3):
        kind = classify(nan_made_by(rank, "fc2", ranks=4), {0, 1, 2, 3})
        assert kind is not None and (kind.code, kind.rank, kind.ranks, kind.module) == (
            "one_rank_data_or_device",
            rank,
            (rank,),
            "fc2",
        )
        assert "ranks " in kind.why and "turned only after the reduction" in kind.why


def test_the_same_bad_batch_on_every_rank_is_all_ranks_together_naming_where_it_entered():
    events = []
    for r in range(2):
        events += [
            ev(r, 3, "actv", "fc1.input", ORIGIN, 0, 0),
            ev(r, 3, "actv", "fc1.input", NAN, 0, 0),
            ev(r, 3, "actv", "fc1.output", NAN, 0, 1),
            ev(r, 3, "grad_unreduced", "fc1.weight", NAN, None, 8),
            ev(r, 3, "grad_reduced", "fc1.weight", NAN, None, 12),
        ]
    kind = classify(events, {0, 1})
    assert kind is not None and (kind.code, kind.rank, kind.ranks, kind.step) == ("all_ranks", None, (0, 1), 3)
    assert (kind.module, kind.tensor) == ("fc1", "forward input of fc1")
    assert kind.why.startswith("every rank (2) turned at step 3 in its own rank-local values")


def test_a_nan_in_one_ranks_batch_is_that_ranks_data_and_a_rank_that_stayed_finite_makes_it_not_all_ranks():
    events = [ev(1, 2, "actv", "embed.input", ORIGIN, 1, 0), ev(1, 2, "actv", "embed.input", NAN, 1, 0)]
    events += [ev(0, 2, "grad_reduced", "embed.weight", NAN, None, 30), ev(1, 2, "grad_reduced", "embed.weight")]
    kind = classify(events, {0, 1})
    assert kind is not None and (kind.code, kind.rank, kind.module) == ("one_rank_data", 1, "embed")
    assert "at the forward input of embed" in kind.why and "look at the batch rank 1 read" in kind.why


def test_a_rank_outlier_first_at_an_input_or_in_its_loss_is_data_and_only_in_its_gradients_data_or_device():
    at_input = classify([ev(2, 7, "actv", "fc1.input", OUTLIER, stage="forward")], {0, 1, 2, 3})
    assert at_input is not None and (at_input.code, at_input.rank, at_input.module) == ("one_rank_data", 2, "fc1")
    assert at_input.why.startswith("rank 2's rank-local statistics left the other ranks' at step 7")
    loss = classify([ev(1, 4, "loss", "loss", OUTLIER, stage="forward")], {0, 1, 2})
    assert loss is not None and (loss.code, loss.module) == ("one_rank_data", "loss")
    grads = classify([ev(0, 9, "grad_unreduced", "fc2.weight", OUTLIER, stage="backward")], {0, 1})
    assert grads is not None and (grads.code, grads.rank, grads.module) == ("one_rank_data_or_device", 0, "fc2")
    made = classify([ev(3, 9, "actv", "fc2.output", OUTLIER, stage="forward")], {0, 1, 2, 3})
    assert made is not None and made.code == "one_rank_data_or_device"


def test_a_replica_check_that_names_the_rank_makes_it_its_copy_of_the_model_and_two_replicas_name_no_one():
    replica = ev(1, 8, "param_updated", "fc1.weight", REPLICA, call=1 << 30)
    kind = classify([replica], {0, 1, 2})
    assert kind is not None and (kind.code, kind.rank, kind.step) == ("one_rank_model_copy", 1, 8)
    kind = classify([ev(1, 6, "actv", "fc1.output", OUTLIER), replica], {0, 1, 2})
    assert kind is not None and (kind.code, kind.rank, kind.step) == ("one_rank_model_copy", 1, 6)
    assert "found its replicated weights differing at step 8" in kind.why
    both = [ev(r, 8, "param_updated", "fc1.weight", REPLICA, call=1 << 30) for r in (0, 1)]
    kind = classify(both, {0, 1})
    assert kind is not None and (kind.code, kind.rank, kind.ranks) == ("one_rank_model_copy", None, (0, 1))
    assert "no majority" in kind.why


def test_values_after_the_reduction_on_one_rank_are_its_copy_and_on_every_rank_the_reduction_or_optimizer():
    one = [ev(2, 4, "exp_avg_sq", "fc1.weight", NAN, call=40), ev(2, 4, "param_updated", "fc1.weight", call=50)]
    kind = classify(one, {0, 1, 2})
    assert kind is not None and (kind.code, kind.rank, kind.module) == ("one_rank_model_copy", 2, "fc1")
    every = [ev(r, 4, "grad_reduced", "fc1.weight", ORIGIN, call=3) for r in range(3)]
    kind = classify(every, {0, 1, 2})
    assert kind is not None and (kind.code, kind.rank, kind.ranks) == ("reduction_or_optimizer", None, (0, 1, 2))
    some = [ev(r, 4, "param_updated", "fc1.weight") for r in (0, 2)]
    kind = classify(some, {0, 1, 2})
    assert kind is not None and (kind.code, kind.ranks) == ("some_ranks", (0, 2))


def test_weights_that_alert_on_one_rank_as_the_step_begins_make_its_rank_local_fault_its_copy_of_the_model():
    events = [
        ev(1, 6, "actv", "fc1.output", TURBULENCE, 0, 1),
        ev(1, 6, "param_origin", "fc1.weight", TURBULENCE, call=20),
        ev(0, 6, "grad_reduced", "fc1.weight", TURBULENCE, call=19),
    ]
    kind = classify(events, {0, 1})
    assert kind is not None and (kind.code, kind.rank) == ("one_rank_model_copy", 1)
    assert "differed as the step began" in kind.why


def test_several_ranks_not_all_are_named_and_one_rank_alone_has_no_kind():
    three = [ev(r, 5, "actv", "fc1.output", TURBULENCE) for r in range(3)]
    kind = classify(three, {0, 1, 2, 3})
    assert kind is not None and (kind.code, kind.ranks) == ("some_ranks", (0, 1, 2))
    assert kind.why.startswith("ranks 0, 1, 2: their data or their devices") and "not on rank 3" in kind.why
    assert classify([ev(0, 5, "actv", "fc1.output")], {0}) is None  # a single process
    assert classify([], {0, 1}) is None


def test_the_output_of_a_collective_the_script_called_is_not_rank_local():
    events = [
        ev(1, 3, "other", "all_reduce@train.py[40]/post", NAN, 0, 4, stage="forward"),
        ev(0, 3, "other", "all_reduce@train.py[40]/pre", NAN, 0, 3, stage="forward"),
        ev(0, 3, "other", "all_reduce@train.py[40]/post", NAN, 0, 4, stage="forward"),
    ]
    kind = classify(events, {0, 1})
    assert kind is not None and (kind.code, kind.rank) == ("one_rank_data_or_device", 0)


def test_each_ranks_anomalies_are_ordered_on_the_data_path_forward_the_loss_backward_own_gradients_reduction():
    rows = [
        ev(0, 1, "param_updated", "w", call=1),
        ev(0, 1, "grad_reduced", "w", call=50),
        ev(0, 1, "grad_unreduced", "w", call=40),
        ev(0, 1, "actv_grad", "b.input_grad", micro=0, call=9),
        ev(0, 1, "loss", "loss", micro=0, call=1 << 29),
        ev(0, 1, "actv", "b.output", micro=0, call=2),
        ev(0, 1, "actv", "a.output", micro=1, call=12),
    ]
    ordered = sorted(rows, key=PathEvent.position)
    assert [(e.category, e.micro_step) for e in ordered] == [
        ("actv", 0),
        ("loss", 0),
        ("actv_grad", 0),
        ("actv", 1),
        ("grad_unreduced", None),
        ("param_updated", None),  # after the reduction, in the order the step recorded them
        ("grad_reduced", None),
    ]
    assert [e.rank_local for e in ordered] == [True] * 5 + [False] * 2


def test_analyse_reads_the_kind_from_dump_records_with_the_first_module_in_its_verdict():
    records = [
        AnomalyEvent(e.rank, e.step, e.micro_step, 0, 0, "forward", e.call_id, e.name, e.category, rule=e.rule)
        for e in nan_made_by(1, "fc2")
    ]
    ordered = order_events(records)
    kind = fault_kind(ordered, {0, 1})
    assert kind is not None and (kind.code, kind.rank, kind.module) == ("one_rank_data_or_device", 1, "fc2")
    assert kind.to_json()["code"] == "one_rank_data_or_device" and kind.to_json()["module"] == "fc2"
    text = verdict(ordered, {0, 1})
    assert "Kind: rank 1: its data or its device; rank-local values" in text
    assert kind.headline() == "one rank: its data or its device (step 5, rank 1, first module fc2)"


@pytest.mark.parametrize("code", sorted(KINDS))
def test_every_code_is_documented_with_what_to_do_about_it(code):
    docs = (ROOT / "docs" / "anomaly.md").read_text(encoding="utf-8")
    row = re.search(rf"^\| `{code}` \|(.+)$", docs, re.M)
    assert row is not None, f"docs/anomaly.md has no row for {code}"
    assert KINDS[code].words in row[1]
