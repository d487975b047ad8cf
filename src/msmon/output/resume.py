"""`append_output`: a restarted job writes into its earlier run's per-rank directories.

msprobe's key: `["start", "end"]`, two time prefixes of output directory names
(`%b%d_%H-%M-%S`, as in `Dec03_21-34-40-rank0-1a2b3c4d`), both ends included; each rank appends
to its directory whose prefix lies in that range. msmon keeps those semantics and fixes what
msprobe leaves to chance:

- a range that matches no directory at all is an error before training starts (msprobe fails
  later on an unset attribute); a rank without a directory in the range gets a new one (a job
  that grew), with a warning; of several directories of one rank in the range, the latest not
  already taken by another monitor of the process is used, and the others are named;
- the series continues without duplicates. A run that says where it starts
  (`set_monitor(start_iteration=N)`) supersedes what the earlier run recorded at steps >= N,
  since after a restart from a checkpoint those steps are trained again: CSV rows of those steps
  are moved to `superseded_from_step{N}/` in the rank directory (nothing is deleted), and the
  new TensorBoard events file starts with TensorBoard's own restart marker (`SessionLog.START`
  at step N, what `SummaryWriter(purge_step=N)` writes), so TensorBoard shows the new values
  from step N on and keeps the earlier ones up to N-1. A run that gives no start step (step 0,
  as under `msmon run`) continues numbering after the last step of the earlier run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import struct
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from ..config import ConfigError
from ..config.time_range import TIME_FORMAT, parse_time
from ..records.layout import CSV_FILE, RANK_DIR, rank_dir_name

logger = logging.getLogger("msmon")

SUPERSEDED = "superseded_from_step{step}"

_claimed: set[str] = set()  # rank directories taken by monitors of this process


def rank_dirs(base: str, time_range: list[str | None] | None = None) -> dict[int, list[str]]:
    """{rank: [directories]} under `base` whose time prefix lies in the range (both ends
    included; no range: all), each list from the earliest to the latest."""
    start = parse_time(time_range[0], "start") if time_range and time_range[0] is not None else None
    end = parse_time(time_range[1], "end") if time_range and time_range[1] is not None else None
    found: dict[int, list[tuple[datetime, str]]] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    for name in names:
        match = RANK_DIR.match(name)
        path = os.path.join(base, name)
        if not match or not os.path.isdir(path):
            continue
        try:
            when = datetime.strptime(match["time"], TIME_FORMAT)
        except ValueError:
            continue
        if (start is None or when >= start) and (end is None or when <= end):
            found.setdefault(int(match["rank"]), []).append((when, name))
    return {rank: [os.path.join(base, n) for _, n in sorted(items)] for rank, items in sorted(found.items())}


def check_range(base: str, time_range: list[str | None]) -> dict[int, list[str]]:
    """The directories the range selects; ConfigError when it selects none."""
    found = rank_dirs(base, time_range)
    if not found:
        raise ConfigError(
            f"append_output: no output directory under {os.path.abspath(base)} has a time prefix "
            f"between {time_range[0]} and {time_range[1]} (directories are named "
            f"<%b%d_%H-%M-%S>-rank<r>-<id>)"
        )
    return found


def open_rank_dir(base: str, rank: int, time_range: list[str | None]) -> tuple[str, Resume | None]:
    """This monitor's output directory (created), and how to resume in it (None: a new one)."""
    if time_range:
        candidates = [d for d in check_range(base, time_range).get(rank, []) if d not in _claimed]
        if candidates:
            chosen = candidates[-1]
            _claimed.add(chosen)
            if len(candidates) > 1:
                logger.warning(
                    "msmon[rank %d]: append_output: %d directories of this rank lie in the range; "
                    "appending to the latest, %s (not %s)",
                    rank,
                    len(candidates),
                    chosen,
                    ", ".join(os.path.basename(c) for c in candidates[:-1]),
                )
            logger.info("msmon[rank %d]: append_output: appending to %s", rank, chosen)
            return chosen, Resume(chosen, rank)
        logger.warning(
            "msmon[rank %d]: append_output: no directory of rank %d lies in the range %s; writing to a new one",
            rank,
            rank,
            time_range,
        )
    path = os.path.join(base, rank_dir_name(rank))
    os.makedirs(path, exist_ok=True)
    return path, None


class Resume:
    """Continuing an earlier run's series in `log_dir`."""

    def __init__(self, log_dir: str, rank: int) -> None:
        self.log_dir = log_dir
        self.rank = rank

    def begin(self, start: int, sinks: Iterable[Any] = ()) -> int:
        """The step the resumed run starts at; the earlier run's records from there on are set
        aside (CSV) or hidden by TensorBoard's restart marker. Called before the first step."""
        last = last_step(self.log_dir)
        if start == 0 and last is not None:
            start = last + 1
            logger.info(
                "msmon[rank %d]: append_output: the earlier run ended at step %d and this one gives no "
                "start step (set_monitor's start_iteration); its steps are numbered from %d",
                self.rank,
                last,
                start,
            )
        moved = supersede_csv_rows(self.log_dir, start)
        if moved:
            logger.warning(
                "msmon[rank %d]: append_output: this run starts at step %d; %d CSV rows the earlier run "
                "recorded at steps >= %d moved to %s",
                self.rank,
                start,
                moved,
                start,
                os.path.join(self.log_dir, SUPERSEDED.format(step=start)),
            )
        for sink in sinks:
            restart = getattr(sink, "restart_at", None)
            if restart is not None:
                restart(start)
        return start


def csv_windows(directory: str) -> list[tuple[str, re.Match]]:
    """The step-window CSV files of a rank directory (not stack_info.csv and the like)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [
        (os.path.join(directory, n), m)
        for n in names
        for m in [CSV_FILE.match(n)]
        if m is not None and os.path.isfile(os.path.join(directory, n))
    ]


def _read_csv(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        return header, [row for row in reader if row]


def _write_csv(path: str, header: list[str], rows: list[list[str]], mode: str = "w") -> None:
    exists = mode == "a" and os.path.exists(path) and os.path.getsize(path) > 0
    with open(path, mode, newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        if not exists:
            writer.writerow(header)
        writer.writerows(rows)


def supersede_csv_rows(directory: str, step: int) -> int:
    """Move the rows of steps >= `step` out of the CSV files into SUPERSEDED; returns how many."""
    moved = 0
    aside = os.path.join(directory, SUPERSEDED.format(step=step))
    for path, match in csv_windows(directory):
        if int(match["last"]) < step:
            continue
        header, rows = _read_csv(path)
        if "step" not in header:
            continue
        column = header.index("step")
        keep = [r for r in rows if _is_before(r[column], step)]
        gone = [r for r in rows if not _is_before(r[column], step)]
        if not gone:
            continue
        os.makedirs(aside, exist_ok=True)
        _write_csv(os.path.join(aside, os.path.basename(path)), header, gone, mode="a")
        if keep:
            tmp = path + ".tmp"
            _write_csv(tmp, header, keep)
            os.replace(tmp, path)
        else:
            os.remove(path)
        moved += len(gone)
    return moved


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _is_before(text: str, step: int) -> bool:
    """Whether a CSV cell holds a step number below `step` (a blank or malformed cell does not)."""
    value = _int(text)
    return value is not None and value < step


def last_step(directory: str) -> int | None:
    """The last step the run in `directory` trained (summary.json) or recorded (CSV rows,
    TensorBoard events), or None when it has none."""
    steps: list[int] = []
    try:
        with open(os.path.join(directory, "summary.json"), encoding="utf-8") as fh:
            summary = json.load(fh)
        # next_step: the step after the last one trained; summaries written before it existed
        # held that number under last_step
        next_step = summary.get("next_step", summary.get("last_step"))
        if isinstance(next_step, int) and next_step > 0:
            steps.append(next_step - 1)
    except (OSError, ValueError, AttributeError):
        pass
    last_windows: dict[str, tuple[int, str]] = {}
    for path, match in csv_windows(directory):
        first = int(match["first"])
        if first >= last_windows.get(match["category"], (-1, ""))[0]:
            last_windows[match["category"]] = (first, path)
    for _, path in last_windows.values():
        header, rows = _read_csv(path)
        if "step" in header:
            column = header.index("step")
            steps.extend(s for s in (_int(r[column]) for r in rows) if s is not None)
    for name in os.listdir(directory):
        if "tfevents" in name:
            step = last_event_step(os.path.join(directory, name))
            if step is not None:
                steps.append(step)
    return max(steps) if steps else None


def last_event_step(path: str) -> int | None:
    """The step of the last event holding statistics in a TensorBoard events file, reading
    record headers only (TFRecord framing: u64 length, u32 crc, data, u32 crc) and parsing
    records from the end."""
    from tensorboard.compat.proto.event_pb2 import Event

    records: list[tuple[int, int]] = []
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            offset = 0
            while offset + 12 <= size:
                fh.seek(offset)
                (length,) = struct.unpack("<Q", fh.read(8))
                if offset + 12 + length + 4 > size:
                    break  # a record cut short by a crash
                records.append((offset + 12, length))
                offset += 12 + length + 4
            for start, length in reversed(records):
                fh.seek(start)
                event = Event.FromString(fh.read(length))
                if event.HasField("summary"):
                    return int(event.step)
    except Exception:  # unreadable or not an events file (protobuf's DecodeError, OSError)
        return None
    return None
