"""`{"do": "notify", ...}`'s delivery: a JSON message POSTed to a URL, or a command run with the
alert in its environment, on a thread of its own.

A slow or dead endpoint never slows or stops training: the training thread only puts a message
on a bounded queue (a full queue drops it, counted), a thread per target sends one message at a
time,
each attempt bounded by the action's `timeout`, retried at most `retries` times (a failed
connection, a timeout, an HTTP 5xx or 429, a command's non-zero exit) with a short backoff,
and when the monitor closes it waits at most CLOSE_SECONDS for what is left: the rest is
dropped, counted in summary.json, and the thread (a daemon) is left behind. The message holds
a Slack-compatible `text` (one line saying what happened), and the alert's fields; a command
gets the same in MSMON_ALERT_* environment variables (MSMON_ALERT_JSON: the whole message).
Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("msmon")

MAX_QUEUED = 256  # messages waiting at most; more are dropped (counted)
CLOSE_SECONDS = 0.5  # what the monitor's close waits for the messages still queued
BACKOFF_SECONDS = 0.5  # before the first retry; doubled at each
ENV_PREFIX = "MSMON_ALERT_"


@dataclass(frozen=True)
class Target:
    """Where an action's messages go, and how hard to try."""

    url: str | None = None
    command: tuple[str, ...] = ()
    timeout: float = 5.0
    retries: int = 2


@dataclass
class Delivery:
    """What happened to the messages (summary.json's `notify`)."""

    sent: int = 0
    failed: int = 0
    dropped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures, one line each
    close_seconds: float = 0.0  # how long the monitor's close waited for the messages left


def environment(message: dict[str, Any]) -> dict[str, str]:
    """The message as MSMON_ALERT_* variables: each scalar field upper-cased, lists joined by
    commas, and MSMON_ALERT_JSON the whole message."""
    out = {f"{ENV_PREFIX}JSON": json.dumps(message, default=str)}
    for key, value in message.items():
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        if value is None or isinstance(value, dict):
            continue
        out[f"{ENV_PREFIX}{key.upper()}"] = str(value)
    return out


class Notifier:
    """One thread per target (a slow endpoint never holds back another's messages), started with
    its first message."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.delivery = Delivery()
        self._queues: dict[Target, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def send(self, target: Target, message: dict[str, Any]) -> None:
        """Queue a message for `target`; never blocks (a full queue drops it)."""
        jobs = self._queues.get(target)
        if jobs is None:
            jobs = self._queues[target] = queue.Queue(maxsize=MAX_QUEUED)
            name = f"msmon-notify-rank{self.rank}-{len(self._queues)}"
            threading.Thread(target=self._run, args=(target, jobs), name=name, daemon=True).start()
        try:
            jobs.put_nowait(message)
        except queue.Full:
            with self._lock:
                self.delivery.dropped += 1

    def close(self, seconds: float = CLOSE_SECONDS) -> Delivery:
        """Wait at most `seconds` in all for the queued messages; those left are dropped (counted)."""
        started = time.monotonic()
        deadline = started + seconds
        left = 0
        for jobs in self._queues.values():
            left += _wait_for(jobs, deadline)
        with self._lock:
            self.delivery.dropped += left
            self.delivery.close_seconds = round(time.monotonic() - started, 3)
        if left:
            logger.warning(
                "msmon[rank %d]: %d alert notification(s) not delivered when the monitor closed (the endpoint is slow "
                "or unreachable); training was not held back",
                self.rank,
                left,
            )
        return self.delivery

    def _run(self, target: Target, jobs: queue.Queue[dict[str, Any]]) -> None:
        while True:
            message = jobs.get()
            try:
                error = _deliver(target, message)
                with self._lock:
                    if error is None:
                        self.delivery.sent += 1
                    else:
                        self.delivery.failed += 1
                        if len(self.delivery.errors) < 5:
                            self.delivery.errors.append(error)
                        if self.delivery.failed == 1:
                            logger.warning("msmon[rank %d]: an alert notification failed: %s", self.rank, error)
            finally:
                jobs.task_done()


def _wait_for(jobs: queue.Queue[dict[str, Any]], deadline: float) -> int:
    """Wait until `jobs` is done or `deadline` passes; how many are left."""
    with jobs.all_tasks_done:
        jobs.all_tasks_done.wait_for(lambda: not jobs.unfinished_tasks, max(deadline - time.monotonic(), 0))
        return jobs.unfinished_tasks


def _deliver(target: Target, message: dict[str, Any]) -> str | None:
    """None once delivered, else why the last attempt failed."""
    error = None
    for attempt in range(target.retries + 1):
        if attempt:
            time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1))
        error, again = _post(target, message) if target.url else _run_command(target, message)
        if error is None or not again:
            return error
    return error


def _post(target: Target, message: dict[str, Any]) -> tuple[str | None, bool]:
    """(why it failed or None, whether to try again)."""
    assert target.url is not None
    request = urllib.request.Request(
        target.url,
        data=json.dumps(message, default=str).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=target.timeout) as response:
            response.read()
        return None, False
    except urllib.error.HTTPError as exc:
        return f"POST {target.url}: HTTP {exc.code}", exc.code >= 500 or exc.code == 429
    except Exception as exc:  # unreachable, refused, timed out
        return f"POST {target.url}: {type(exc).__name__}: {exc}", True


def _run_command(target: Target, message: dict[str, Any]) -> tuple[str | None, bool]:
    try:
        done = subprocess.run(
            list(target.command),
            env={**os.environ, **environment(message)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=target.timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"{target.command[0]}: timed out after {target.timeout:g} s", True
    except OSError as exc:
        return f"{target.command[0]}: {exc}", False
    if done.returncode:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] if done.stderr else []
        return f"{target.command[0]}: exit code {done.returncode}{': ' + tail[0] if tail else ''}", True
    return None, False
