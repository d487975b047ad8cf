"""The trackers' lanes, made without torchrun: each rank's numbers read from its step record, then
combined as the logging rank does, checked against a plain-Python recomputation of the rows (the
max over every rank's tensors, a NaN the largest, the rank and tensor holding it, the median of
the ranks' medians, the loss per rank); the level and its announcements; and the two real
clients' runs (W&B offline, MLflow on a local file store): names valid for each, the key budget
said once, MLflow's batch limits kept. The 2-rank jobs are tests/e2e/test_trackers_e2e.py."""

from __future__ import annotations

import json
import logging
import math
import posixpath
import re
import statistics
import subprocess
import sys

import torch

from msmon.collectors.trackers.lanes import LaneCombiner, LaneReader
from msmon.output.category_ops import CategoryColumns
from msmon.output.sinks.tracker import StepLanes
from msmon.records.rows import RowKey, StepRecord

OPS = ["norm", "max"]
KEYS = [RowKey("grad_reduced", "fc1.weight"), RowKey("actv", "fc1.output", micro_step=0)]
KEYS += [RowKey("grad_reduced", "fc2.weight"), RowKey("actv", "fc2.output", micro_step=0)]
# step -> rank -> the rows' [norm, max]; rank 1's fc2.weight gradient turns NaN at step 2
VALUES = {
    0: {0: [[1.0, 0.5], [4.0, 2.0], [3.0, 0.25], [2.0, 1.0]], 1: [[1.0, 0.5], [5.0, 1.5], [3.0, 0.25], [1.0, 3.0]]},
    1: {0: [[2.0, 0.5], [4.0, 2.0], [1.0, 0.25], [2.0, 1.0]], 1: [[2.0, 0.5], [6.0, 1.5], [1.0, 0.25], [1.0, 3.0]]},
    2: {
        0: [[2.0, 0.5], [4.0, 2.0], [1.0, 0.25], [2.0, 1.0]],
        1: [[2.0, 0.5], [6.0, 1.5], [math.nan, 0.25], [1.0, 3.0]],
    },
}
ALERTS = {0: [0, 0], 1: [0, 2], 2: [0, 1]}


def lanes_of(step: int, combiner: LaneCombiner) -> StepLanes:
    tables, names = [], []
    for rank in (0, 1):
        reader = LaneReader(CategoryColumns({}), [], explicit=False)
        record = StepRecord(step, rank, OPS, KEYS, table=torch.tensor(VALUES[step][rank], dtype=torch.float64))
        mine = reader.read(record, loss=0.5 + rank + step, alerts=ALERTS[step][rank])
        tables.append(mine.payload)
        names.append(mine.names)
    return combiner.combine(torch.stack(tables), names, {})


def recomputed(step: int, category: str, op: str) -> tuple[float, int, str, float]:
    """(max, its rank, its tensor, median of the ranks' medians) from the rows themselves."""
    j = OPS.index(op)
    rows = [i for i, k in enumerate(KEYS) if k.category == category]
    best: tuple[float, int, str] | None = None
    medians = []
    for rank in (0, 1):
        values = [VALUES[step][rank][i][j] for i in rows]
        medians.append(statistics.median([v for v in values if not math.isnan(v)]))
        for i, v in zip(rows, values):
            bigger = best is None or (math.isnan(v) and not math.isnan(best[0])) or v > best[0]
            if bigger:
                best = (v, rank, KEYS[i].display_name())
    assert best is not None
    return (*best, statistics.median(medians))


def test_the_lanes_are_the_max_and_median_over_every_ranks_tensors_with_the_holder_and_the_loss_per_rank():
    combiner = LaneCombiner([0, 1])
    for step in VALUES:
        lanes = lanes_of(step, combiner)
        for category in ("grad_reduced", "actv"):
            for op in OPS:
                top, rank, tensor, median = recomputed(step, category, op)
                lane = f"msmon/{category}/{op}"
                got = lanes.values[f"{lane}_max"]
                assert got == top or (math.isnan(got) and math.isnan(top)), (step, lane)
                assert lanes.values[f"{lane}_max_rank"] == rank and lanes.values[f"{lane}_max_tensor"] == tensor
                assert lanes.values[f"{lane}_median"] == median, (step, lane)
        losses = [0.5 + step, 1.5 + step]
        assert [lanes.values[f"msmon/loss/{s}"] for s in ("min", "median", "max")] == [
            min(losses),
            statistics.median(losses),
            max(losses),
        ]


def test_without_a_kind_told_the_verdict_is_the_level_the_step_shows_and_each_level_is_announced_once():
    combiner = LaneCombiner([0, 1])
    steps = [lanes_of(step, combiner) for step in VALUES]
    assert [lanes.verdict for lanes in steps] == ["ok", "alert", "nonfinite"]
    assert [lanes.values["msmon/verdict"] for lanes in steps] == [0.0, 1.0, 2.0]
    assert [lanes.values["msmon/verdict_text"] for lanes in steps] == ["ok", "alert", "nonfinite"]
    assert [lanes.values["msmon/alerts"] for lanes in steps] == [0.0, 2.0, 1.0]
    assert steps[2].values["msmon/alerts_total"] == 3.0
    assert steps[0].rise is None and steps[1].rise == "2 alerts on ranks [1]"
    assert steps[2].rise == "non-finite: grad_reduced norm nan on rank 1 (0:fc2.weight); 1 alerts on ranks [1]"
    assert lanes_of(2, combiner).rise is None  # the same level again: said once
    assert not any(lanes.told for lanes in steps)  # no alert came with the lanes: no kind


def test_each_category_keeps_its_own_ops_in_the_lanes_too():
    reader = LaneReader(CategoryColumns({"actv": ["max"]}), ["grad_reduced/fc1*"], explicit=True)
    record = StepRecord(0, 0, OPS, KEYS, table=torch.tensor(VALUES[0][0], dtype=torch.float64))
    mine = reader.read(record, loss=None, alerts=0)
    lanes = LaneCombiner([0]).combine(mine.payload[None], [mine.names], mine.tensors)
    assert "msmon/actv/max_max" in lanes.values and "msmon/actv/norm_max" not in lanes.values
    assert mine.tensors == {
        "msmon/tensor/grad_reduced/fc1.weight/norm": 1.0,
        "msmon/tensor/grad_reduced/fc1.weight/max": 0.5,
    }
    assert "msmon/loss/min" not in lanes.values  # no loss rows: no loss lanes


MSPROBE_KEYS = {
    "msmon/actv/norm_max_tensor": "0:layers.0.attn:1",
    "msmon/tensor/actv/0:layers.0.attn/micro1/norm": 1.0,  # a name msprobe's tags give: ':' in it
    "msmon/tensor/other/all_reduce@train.py[12]/pre/norm": 2.0,
    "msmon/tensor/actv/Fc1/norm": 3.0,
    "msmon/tensor/actv/fc1/norm": 4.0,  # the same W&B name as the one above (W&B's names ignore case)
    "msmon/tensor/grad_reduced/../x/./1st.weight/norm": 5.0,
    "msmon/tensor/grad_reduced/1st.weight/norm": 6.0,  # over the budget
}
WANDB_NAME = re.compile(r"[_A-Za-z][_A-Za-z0-9]*(/[_A-Za-z][_A-Za-z0-9]*)*")


def test_wandb_names_keep_to_its_rules_apart_from_each_other_and_within_the_budget(tmp_path, monkeypatch, caplog):
    import wandb  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)

    from msmon.output.sinks.wandb_sink import WandbRun

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")

    run = WandbRun(wandb.init(project="p", name="unit", reinit="create_new"), own=True, max_keys=7)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        for step in range(2):
            run.send(StepLanes(step, dict(MSPROBE_KEYS)))
    run.close()
    names = list(run._names.values())
    assert all(WANDB_NAME.fullmatch(n) for n in names), names
    assert len({n.casefold() for n in names}) == len(names) == 7  # the step axis and 6 keys: the budget
    assert [r.message for r in caplog.records].count(
        "msmon: the W&B run's key budget (tracker.max_keys = 7) is full at step 0: 1 keys are not sent, from "
        "msmon/tensor/grad_reduced/1st.weight/norm on; the other formats keep every value (said once)"
    ) == 1
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [str(__import__("pathlib").Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [json.loads(line)["history"]["item"] for line in out.splitlines() if '"type":"history"' in line]
    assert [row["msmon/step"] for row in rows] == [0, 1]
    assert {k for k in rows[0] if not k.startswith("_")} == set(names)


def test_mlflow_takes_thousands_of_keys_in_batches_within_its_limits_and_names_without_colons(tmp_path, monkeypatch):
    import mlflow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
    from mlflow import MlflowClient

    from msmon.output.sinks.mlflow_sink import MlflowRun

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    run = MlflowRun(client, run_id, own=True, max_keys=5000)
    values: dict[str, float | str] = dict(MSPROBE_KEYS)
    values.update({f"msmon/tensor/actv/layers.{i}/norm": float(i) for i in range(2500)})
    values.update({f"msmon/actv/op{i}_max_tensor": "x" * 3000 for i in range(150)})  # 450 kB of tags
    run.send(StepLanes(7, values))
    run.close()
    stored = client.get_run(run_id)
    assert len(stored.data.metrics) == 2500 + 6 and stored.info.status == "FINISHED"
    texts = [k for k in stored.data.tags if k.startswith("msmon/")]
    assert len(texts) == 151
    for name in [*stored.data.metrics, *texts]:
        assert re.fullmatch(r"[A-Za-z0-9_\-. /]+", name) and posixpath.normpath(name) == name, name
    assert stored.data.metrics["msmon/tensor/actv/layers.2499/norm"] == 2499.0
    assert stored.data.tags["msmon.verdict"] == "ok"
