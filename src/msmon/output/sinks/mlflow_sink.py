"""`format: [..., "mlflow"]`: the lanes to MLflow (output/sinks/tracker.py says what is sent).

The run is the script's `mlflow.active_run()` when it started one (read on the training thread:
MLflow keeps the active run per thread), else one msmon creates in the experiment
`tracker.project` (default "msmon"), named after the msmon run, on the tracking URI MLflow is
set up with (MLFLOW_TRACKING_URI). Everything goes through `MlflowClient` with the run's id,
each metric at its own step (msmon's step), so the script's metrics and steps are left alone.
Batches keep within MLflow's limits (1,000 metrics, 100 tags, 1,000 entities and 1 MB per
`log_batch`). Names keep to the characters MLflow takes on every system (letters, digits, `_`,
`-`, `.`, ` `, `/`: no `:`, which msprobe's tags hold) and to a normalised path. Texts (the
tensor holding a lane's max) are tags, set when they change; the verdict is the tag
`msmon.verdict` (the kind's code once told, else the step's level). A kind told sets
`msmon.verdict.kind`, `.step`, `.rank`, `.module`, `.action` and `.why`; a level first reached
sets `msmon.first_<level>`; the n-th escalation of alert.actions sets `msmon.escalation.<n>`.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from ...anomaly.fault_kind import KINDS
from . import sink_format
from .tracker import Escalated, TrackerRun, TrackerSink, Value

if TYPE_CHECKING:
    from ...anomaly.fault_kind import FaultKind
    from ...config import MonitorConfig

REQUIRES = {
    "mlflow": "msmon[mlflow]"
}  # {module: what to install}, read by sinks.check_formats before training; mlflow-skinny will do
MAX_METRICS, MAX_TAGS, MAX_ENTITIES, MAX_BYTES = 1000, 100, 1000, 1_000_000  # one log_batch's limits
MAX_NAME = 250  # MLflow's longest key
MAX_TAG_VALUE = 8000  # MLflow's longest tag value
_OTHER_CHARACTER = re.compile(r"[^A-Za-z0-9_\-. /]")


@sink_format("mlflow")
class MlflowSink(TrackerSink):
    @classmethod
    def script_run(cls) -> Any:
        mlflow = sys.modules.get("mlflow")
        run = mlflow.active_run() if mlflow is not None else None
        return run.info.run_id if run is not None else None

    @classmethod
    def connect(cls, config: MonitorConfig, run_name: str, script_run: Any) -> TrackerRun:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient()
        if script_run is not None:
            return MlflowRun(client, script_run, own=False, max_keys=config.tracker.max_keys)
        name = config.tracker.project or "msmon"
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(name)
            except MlflowException:  # another job made it meanwhile
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        run = client.create_run(experiment_id, run_name=run_name, tags={"msmon.run": run_name})
        return MlflowRun(client, run.info.run_id, own=True, max_keys=config.tracker.max_keys)


class MlflowRun(TrackerRun):
    tracker = "MLflow"

    def __init__(self, client: Any, run_id: str, own: bool, max_keys: int) -> None:
        super().__init__(own, max_keys)
        self.client = client
        self.run_id = run_id
        self._tags: dict[str, str] = {}  # the tags set so far: a text is set again only when it changes

    def valid(self, key: str) -> str:
        parts = [p for p in _OTHER_CHARACTER.sub("_", key).split("/") if p.strip(" ") not in ("", ".", "..")]
        name = "/".join(parts) or "_"
        if len(name) > MAX_NAME:  # cut, kept apart from other cut names by a digest of the whole
            name = name[: MAX_NAME - 9] + "_" + hashlib.blake2b(key.encode(), digest_size=4).hexdigest()
        return name

    def _log(self, step: int, values: dict[str, Value]) -> None:
        from mlflow.entities import Metric, RunTag

        stamp = int(time.time() * 1000)
        metrics = [Metric(k, float(v), stamp, step) for k, v in values.items() if not isinstance(v, str)]
        tags = [RunTag(k, v) for k, v in values.items() if isinstance(v, str) and self._tags.get(k) != v]
        self._batches(metrics, tags)
        self._tags.update({t.key: t.value for t in tags})

    def _batches(self, metrics: list[Any], tags: list[Any]) -> None:
        """log_batch calls within MLflow's limits (sizes estimated from above: key, value, step, time)."""
        batch_metrics: list[Any] = []
        batch_tags: list[Any] = []
        size = 0
        for entity in [*metrics, *tags]:
            is_tag = not hasattr(entity, "step")
            cost = len(entity.key) + (len(entity.value.encode()) + 40 if is_tag else 96)
            full = (
                len(batch_metrics) + len(batch_tags) >= MAX_ENTITIES
                or (len(batch_tags) >= MAX_TAGS if is_tag else len(batch_metrics) >= MAX_METRICS)
                or size + cost > MAX_BYTES // 2  # half: JSON quoting and the request's own fields
            )
            if full:
                self.client.log_batch(self.run_id, metrics=batch_metrics, tags=batch_tags)
                batch_metrics, batch_tags, size = [], [], 0
            (batch_tags if is_tag else batch_metrics).append(entity)
            size += cost
        if batch_metrics or batch_tags:
            self.client.log_batch(self.run_id, metrics=batch_metrics, tags=batch_tags)

    def _set_tags(self, tags: dict[str, str]) -> None:
        """Tags of msmon's own (`msmon.`), set in one batch, each only when it changed."""
        from mlflow.entities import RunTag

        changed = [RunTag(k, v[:MAX_TAG_VALUE]) for k, v in tags.items() if self._tags.get(k) != v[:MAX_TAG_VALUE]]
        if changed:
            self._batches([], changed)
            self._tags.update({t.key: t.value for t in changed})

    def _rose(self, step: int, level: str, text: str) -> None:
        self._set_tags({f"msmon.first_{level}": f"step {step}: {text}"})

    def _told(self, step: int, kind: FaultKind, level: str, rise: str | None) -> None:
        rank = str(kind.rank) if kind.rank is not None else ", ".join(map(str, kind.ranks))
        tags = {
            "msmon.verdict": kind.code,
            "msmon.verdict.kind": kind.kind,
            "msmon.verdict.step": str(kind.step),
            "msmon.verdict.rank": rank,
            "msmon.verdict.module": kind.module or "",
            "msmon.verdict.action": KINDS[kind.code].action,
            "msmon.verdict.why": kind.why,
        }
        if rise:
            self._rose(step, level, rise)
        self._set_tags(tags)

    def _escalated(self, escalation: Escalated) -> None:
        self._set_tags({f"msmon.escalation.{escalation.number}": escalation.text()})

    def send(self, lanes: Any) -> None:
        super().send(lanes)
        self._set_tags({"msmon.verdict": lanes.verdict})

    def _finish(self) -> None:
        self.client.set_terminated(self.run_id)
