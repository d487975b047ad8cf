"""`format: [..., "wandb"]`: the lanes to Weights & Biases (output/sinks/tracker.py says what is sent).

The run is the script's `wandb.run` when it made one, else one msmon makes with
`reinit="create_new"` (so that it never becomes, nor finishes, the script's `wandb.run`), in the
project `tracker.project` (default "msmon"), named after the msmon run. msmon's keys are drawn
against their own step axis, `msmon/step` (`define_metric`), never W&B's `_step`: in the script's
run they join the row the script is logging (`commit=False`), so the script's step counter is
left alone; W&B keeps one value per key and row, so where the script logs fewer rows than msmon
records steps, a row holds the last of them (the other formats keep every step). In msmon's own
run every recorded step is a row. Names keep to W&B's rules for a metric name that sorts and
filters: `/`-separated parts of letters, digits and underscores, none starting with a digit.
W&B alerts (`run.alert`): a kind of fault told or changed (its words, rank, first module and
what to do), a level first reached (the first alert, the first non-finite statistic) when no
kind is told at that step, and each escalation of alert.actions (the steps escalated and why).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from . import sink_format
from .tracker import STEP_KEY, Escalated, RunEnded, TrackerRun, TrackerSink, Value, kind_text

if TYPE_CHECKING:
    from ...anomaly.fault_kind import FaultKind
    from ...config import MonitorConfig

REQUIRES = {"wandb": "msmon[wandb]"}  # {module: what to install}, read by sinks.check_formats before training
_NOT_A_NAME_CHARACTER = re.compile(r"[^A-Za-z0-9_]")


@sink_format("wandb")
class WandbSink(TrackerSink):
    @classmethod
    def script_run(cls) -> Any:
        wandb = sys.modules.get("wandb")
        return getattr(wandb, "run", None) if wandb is not None else None

    @classmethod
    def connect(cls, config: MonitorConfig, run_name: str, script_run: Any) -> TrackerRun:
        import wandb

        if script_run is not None:
            return WandbRun(script_run, own=False, max_keys=config.tracker.max_keys)
        run = wandb.init(
            project=config.tracker.project or "msmon",
            name=run_name,
            reinit="create_new",
        )
        return WandbRun(run, own=True, max_keys=config.tracker.max_keys)


class WandbRun(TrackerRun):
    tracker = "W&B"
    case_blind = True  # W&B's metric names are case-insensitive

    def __init__(self, run: Any, own: bool, max_keys: int) -> None:
        super().__init__(own, max_keys)
        self.run = run
        self.step_name = self.name_of(STEP_KEY) or STEP_KEY
        run.define_metric(self.step_name)
        run.define_metric(self.valid("msmon") + "/*", step_metric=self.step_name)

    def valid(self, key: str) -> str:
        parts = [_NOT_A_NAME_CHARACTER.sub("_", part) or "_" for part in key.split("/")]
        return "/".join("_" + part if part[0].isdigit() else part for part in parts)

    def _log(self, step: int, values: dict[str, Value]) -> None:
        if not self.own and getattr(self.run, "_is_finished", False):
            raise RunEnded(f"the script finished its W&B run before msmon logged step {step}")
        self.run.log({self.step_name: step, **values}, commit=self.own)

    def _alert(self, title: str, text: str, error: bool) -> None:
        import wandb

        client: Any = wandb  # AlertLevel is not in wandb's declared exports; the lint environment has no wandb at all
        level = client.AlertLevel.ERROR if error else client.AlertLevel.WARN
        self.run.alert(title=title, text=text, level=level)

    def _rose(self, step: int, level: str, text: str) -> None:
        self._alert(f"msmon: {level} at step {step}", text, error=level == "nonfinite")

    def _told(self, step: int, kind: FaultKind, level: str, rise: str | None) -> None:
        also = f" At step {step}: {rise}." if rise else ""
        self._alert(f"msmon: {kind.headline()}", kind_text(kind) + also, error=True)

    def _escalated(self, escalation: Escalated) -> None:
        self._alert(escalation.title(), escalation.text(), error=False)

    def _finish(self) -> None:
        self.run.finish()
