"""Monitoring inside one process of a job, without a line of msmon in the script.

Started by the job's bootstrap once the script imports torch (`start`), or by
`import msmon.auto` (`start_here`), in every process that may be a training rank. It builds
the session every instrumentor shares, with the factory of the monitors they attach (the
api's TrainerMon: the hooks sit below the api and never import it), and switches the
instrumentors on as their frameworks are imported. The process turns out to be a rank when it
builds an optimizer (or a framework hands one over): from then on its worker record in the
bootstrap directory tells the launcher where each monitor wrote. A process that never does is
a launcher or a helper and says nothing, unless something else shows it was a rank
(`unmonitored_rank`).

A forked child inherits the session in memory. The child of a rank (marked in the environment
by then: a DataLoader or compile worker) is the rank's helper and never attaches. The child of
a process that is no rank yet may be a rank itself: `torch.multiprocessing.start_processes(...,
start_method="fork")` starts ranks this way from a parent that only imported torch. Such a
child takes the session over as its own, with a record of its own (`_after_fork_in_child`);
a DataLoader worker among them is still refused when it would attach (Session.may_attach).
multiprocessing ends a forked child with os._exit, past atexit: its end-of-process work is
registered with multiprocessing too (system/process_end.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from ... import hooks
from ...config.resolved import resolved
from ...hooks import explicit
from ...output.directory import ENV_OUTPUT_DIR, output_base_dir
from ...records.layout import rank_dir_name
from ...records.runs import ENV_RUN_ID
from ...system import exit_drain, lifecycle, process_end
from ...system.distributed import LOCAL_RANK_VARIABLES, current_rank, environment_rank, is_initialized
from ...system.environment import ENV_JOB_MODE
from . import boot
from .job_directory import DEFAULT_CONFIG

if TYPE_CHECKING:
    from ...api import TrainerMon

logger = logging.getLogger("msmon")

ENV_CONFIG = "MSMON_CONFIG"

_session: hooks.Session | None = None
_record: WorkerRecord | None = None
_unmonitored: Unmonitored | None = None


def start(bootstrap_dir: str) -> hooks.Session:
    """Monitor this worker of a job launched by `msmon run` (its bootstrap directory)."""
    if _session is not None:
        return _session
    lifecycle.setup_logging()
    exit_drain.track_process_groups()  # the job's collectives end before the interpreter does
    settings = boot.read_settings(bootstrap_dir)
    if settings.get("output_dir") and not os.environ.get(ENV_OUTPUT_DIR):
        os.environ[ENV_OUTPUT_DIR] = settings["output_dir"]  # launchers that filter the environment
    if settings.get("run_id") and not os.environ.get(ENV_RUN_ID):
        os.environ[ENV_RUN_ID] = settings["run_id"]
    os.environ[ENV_JOB_MODE] = settings.get("mode") or "run"  # `msmon struct`: the ranks' lines say less
    session = hooks.Session.from_file(worker_config_path(bootstrap_dir, settings), build_monitor)
    session.stop_said_by_launcher = True  # the worker record carries the reason to the launcher's one line
    record = WorkerRecord(os.path.join(bootstrap_dir, boot.WORKERS_DIR), session)
    session.listeners.append(record.on_event)
    return _begin(session, record)


def start_here() -> hooks.Session | None:
    """`import msmon.auto`: monitor this process, unless it is the child of a monitored one
    (a DataLoader worker re-importing the script) or already monitored."""
    role = boot.decide_role(os.environ, os.getpid(), launcher=None)
    if role == boot.ACTIVE or _session is not None:
        return _session
    if role != boot.WORKER:
        return None
    if boot.rank_by_environment(os.environ):
        boot.mark_active(os.environ, os.getpid())  # else when it builds an optimizer
    bootstrap_dir = os.environ.get(boot.ENV_BOOTSTRAP_DIR)
    if bootstrap_dir and os.path.isfile(os.path.join(bootstrap_dir, boot.SETTINGS_FILE)):
        return start(bootstrap_dir)  # under `msmon run`, with sitecustomize disabled (python -E/-I)
    lifecycle.setup_logging()
    config_path = os.environ.get(ENV_CONFIG) or DEFAULT_CONFIG
    return _begin(hooks.Session.from_file(config_path, build_monitor), None)


def build_monitor(config_path: str) -> TrainerMon:
    """The monitor of each attachment: the api's TrainerMon on the session's config file. The
    api, and the collectors, statistics and output under it, is imported at the first
    attachment (about 90 modules): a process of the job that never attaches (a launcher's, a
    helper's) does not load it."""
    from ...api import TrainerMon

    return TrainerMon(config_path)


def worker_config_path(bootstrap_dir: str, settings: dict) -> str:
    """The user's own config file when this machine sees it (so that editing it during the
    run takes effect, msprobe's dynamic workflow), else the copy the launcher resolved."""
    source = settings.get("config_source")
    if source and os.path.isfile(source):
        return source
    return os.path.join(bootstrap_dir, settings["config"])


# what only a training rank does: build an optimizer (or be handed one), stop on its config
RANK_EVENTS = ("attached", "skipped", "deferred", "stopped")


def _begin(session: hooks.Session, record: WorkerRecord | None) -> hooks.Session:
    global _session, _record, _unmonitored
    _session, _record = session, record
    unmonitored = _unmonitored = Unmonitored()
    session.listeners.insert(0, _mark_rank)
    session.listeners.append(unmonitored.on_event)
    # runs after the monitors closed (last in, first out), in a multiprocessing child too
    process_end.at_end(lambda: _report_at_exit(session, record, unmonitored))
    os.register_at_fork(after_in_child=_after_fork_in_child)
    process_end.in_forked_children(session, _report_in_forked_child)
    explicit.watch(session)
    hooks.enable(session)
    return session


def _after_fork_in_child() -> None:
    """A forked child: the child of a rank stays its helper; the child of a process that is no
    rank (yet) takes the session over, as a rank may (module docstring). The report at exit
    it inherited then speaks for it (a multiprocessing child registers its own:
    `_report_in_forked_child`)."""
    session = _session
    if session is None or session.in_owner_process() or boot.is_child_here():
        return
    if session.monitors or session.stood_down:  # the parent attached: a rank, marked by then
        return
    session.continue_in_fork()
    if _record is not None:
        _record.continue_in_fork(session)
    if _unmonitored is not None:
        _unmonitored.forget()


def _report_in_forked_child() -> None:
    """At the start of a multiprocessing child forked from this process: its report at the end
    of the process, which os._exit would skip."""
    session = _session
    if session is not None and session.in_owner_process() and _unmonitored is not None:
        process_end.at_end(lambda: _report_at_exit(session, _record, _unmonitored))


def _mark_rank(event: str, _info: dict) -> None:
    """This process is a training rank: the processes it starts from now on (DataLoader and
    compile workers) are its helpers."""
    if event in RANK_EVENTS:
        boot.mark_active(os.environ, os.getpid())


def _report_at_exit(session: hooks.Session, record: WorkerRecord | None, unmonitored: Unmonitored) -> None:
    if not session.in_owner_process():
        return
    if record is not None:
        record.finish(session.monitors)
    attached = record.data["monitors"] if record is not None else session.monitors
    if attached or unmonitored.attached or session.error is not None or session.stood_down:
        return  # monitored (a monitor closed with its dropped optimizer counts), said why already, or the script's own
    if not unmonitored.built_any() and not unmonitored_rank(record, session.forked):
        return  # a launcher's process (accelerate's, deepspeed's, the mp.spawn parent) or a helper
    reason = unmonitored.reason()
    log_dir = unmonitored.write_summary(session, reason)
    logger.info(
        "msmon[rank %d]: no optimizer was monitored in this process (%s); nothing was recorded%s",
        current_rank(),
        reason,
        f" ({log_dir}/summary.json says so)" if log_dir else "",
    )
    if record is not None:
        record.data["rank"] = current_rank()
        if log_dir:
            record.data["log_dir"] = os.path.abspath(log_dir)
        record.confirm()


def unmonitored_rank(record: WorkerRecord | None, forked: bool = False) -> bool:
    """Whether a process that built no optimizer was a training rank all the same (its
    directory then says that nothing was monitored, and why): torch.distributed ran in it, or
    a torch elastic agent started it as a rank, or it is the job's first process and no other
    process of the job was a rank (a plain `python train.py`). Never a DataLoader worker, nor
    another forked helper (`forked`: a child that took the session over) that started no
    torch.distributed."""
    if hooks.in_dataloader_worker():
        return False
    if is_initialized() or boot.rank_by_environment(os.environ):
        return True
    if forked:
        return False
    if record is None:  # `import msmon.auto` without `msmon run`: the script asked for this process
        return True
    return boot.is_first_process(os.environ) and not record.others()


class Unmonitored:
    """Why a process monitored nothing, from the instrumentors' events, and the rank's
    output directory that says so: a summary.json with no step, as a monitor's would be."""

    def __init__(self) -> None:
        self.skipped: list[str] = []
        self.deferred: list[str] = []
        self.attached = 0  # monitors attached here (a monitor closed early, its optimizer dropped, counts too)

    def on_event(self, event: str, info: dict) -> None:
        if event == "attached":
            self.attached += 1
        elif event == "skipped":
            self.skipped.append(f"{info['optimizer']}: {info['reason']}")
        elif event == "deferred":
            self.deferred.append(
                f"{info['optimizer']} was built but never stepped; {info['reason']}, so msmon waited for its first step"
            )

    def forget(self) -> None:
        """A forked child that took the session over: what its parent built is not its own."""
        self.skipped.clear()
        self.deferred.clear()
        self.attached = 0

    def built_any(self) -> bool:
        """An optimizer was built here (skipped or left for a step that never came)."""
        return bool(self.skipped or self.deferred)

    def reason(self) -> str:
        return "; ".join(self.skipped or self.deferred) or "no torch.optim optimizer was created"

    def write_summary(self, session: hooks.Session, reason: str) -> str | None:
        """The rank's directory with config.json and summary.json; None on a rank the config's
        module_ranks leaves out, or when the output cannot be written."""
        rank = current_rank()
        ranks = session.config.module_ranks
        if ranks and rank not in ranks:
            return None
        log_dir = os.path.join(output_base_dir(), rank_dir_name(rank))
        summary = {
            "rank": rank,
            "output_dir": log_dir,
            "steps_recorded": 0,
            "alerts": 0,
            "first_nonfinite": None,
            "last_step": None,
            "next_step": None,
            "output_stopped": None,
            "note": reason,
        }
        try:
            os.makedirs(log_dir, exist_ok=True)
            for name, data in (("config.json", resolved(session.config)), ("summary.json", summary)):
                with open(os.path.join(log_dir, name), "w", encoding="utf-8") as fh:
                    json.dump(data, fh, indent=2)
                    fh.write("\n")
        except OSError as exc:  # the process ends anyway; the launcher's line still says why
            logger.debug("msmon[rank %d]: cannot write %s: %s", rank, log_dir, exc)
            return None
        return log_dir


class WorkerRecord:
    """This rank's file in the bootstrap directory: who it is and where its monitors write.
    Written once the process shows it is a rank (`confirm`), then rewritten (atomically) at
    each attachment, so even a rank killed later leaves the launcher something to report."""

    def __init__(self, directory: str, session: hooks.Session) -> None:
        self.directory = directory
        self.path = ""
        self.confirmed = False
        self.data: dict[str, Any] = {}
        self._of_this_process(session)

    def _of_this_process(self, session: hooks.Session) -> None:
        self.path = os.path.join(self.directory, f"{socket.gethostname()}-{os.getpid()}.json")
        self.confirmed = False
        self.data = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": current_rank(),
            "local_rank": environment_rank(LOCAL_RANK_VARIABLES),
            "config": session.config_path,
            "monitors": [],
            "skipped": [],
        }

    def continue_in_fork(self, session: hooks.Session) -> None:
        """A forked child that took the session over: a record of its own, written once it shows
        it is a rank."""
        self._of_this_process(session)

    def confirm(self) -> None:
        """This process is a rank: its record is written from now on."""
        self.confirmed = True
        self.write()

    def others(self) -> list[str]:
        """The records of the job's other ranks written so far."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        own = os.path.basename(self.path)
        return [n for n in names if n.endswith(".json") and n != own]

    def on_event(self, event: str, info: dict) -> None:
        if event in RANK_EVENTS:
            self.confirmed = True
        if event == "attached":
            monitor = info["monitor"]
            self.data["rank"] = monitor.rank
            self.data["monitors"].append(
                {
                    "rank": monitor.rank,
                    "log_dir": os.path.abspath(monitor.log_dir) if monitor.log_dir else None,
                    "output_base": os.path.abspath(monitor.output_base),
                    "optimizer": info["optimizer"],
                    "models": info["models"],
                    "attached_at": info["when"],
                }
            )
        elif event == "skipped":
            self.data["skipped"].append({"optimizer": info["optimizer"], "reason": info["reason"]})
        elif event == "stopped":
            self.data["error"] = info["reason"]
        elif event == "closed":
            if not self._note_output(info["monitor"]):
                return
        elif event == "withdrawn":  # the script's own TrainerMon took over (hooks/explicit.py)
            gone = os.path.abspath(info["log_dir"]) if info.get("log_dir") else None
            self.data["monitors"] = [m for m in self.data["monitors"] if m["log_dir"] != gone]
        elif event == "explicit":
            self._add_explicit(info["monitor"])
        else:
            return
        self.write()

    def _add_explicit(self, monitor: Any) -> None:
        """The script's own TrainerMon: the launcher's line for this rank points at its output."""
        self.confirmed = True
        self.data["rank"] = monitor.rank
        self.data["monitors"].append(
            {
                "rank": monitor.rank,
                "log_dir": os.path.abspath(monitor.log_dir) if monitor.log_dir else None,
                "output_base": os.path.abspath(monitor.output_base),
                "optimizer": "the script's own TrainerMon",
                "models": [],
                "attached_at": "the script",
            }
        )

    def finish(self, monitors: list[Any]) -> None:
        """At exit, after the monitors closed: keep why a monitor's output stopped (its
        summary.json may be on the very disk that filled up)."""
        if any([self._note_output(monitor) for monitor in monitors]):
            self.write()

    def _note_output(self, monitor: Any) -> bool:
        stopped = getattr(monitor, "output_stopped", None)
        log_dir = os.path.abspath(monitor.log_dir) if monitor.log_dir else None
        for entry in self.data["monitors"]:
            if stopped is not None and entry["log_dir"] == log_dir and entry.get("output_stopped") != stopped:
                entry["output_stopped"] = stopped
                return True
        return False

    def write(self) -> None:
        if not self.confirmed:
            return
        tmp = self.path + ".tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.data, fh, indent=2)
            os.replace(tmp, self.path)
        except OSError as exc:  # the summary line is lost, never the monitoring
            logger.warning("msmon[rank %d]: cannot write %s: %s", current_rank(), self.path, exc)
