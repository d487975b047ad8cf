"""Offline conversion of monitor output, rank by rank: CSV -> TensorBoard and TensorBoard -> CSV.

CSV -> TensorBoard reads each rank directory's `{category}_{first}-{last}.csv` files and writes
an events file per rank. Tags are msmon's live ones by default
(`{vpp}:{name}[:{micro}]/rank{r}/{category}_{op}`, collectives `{op}@{site}/rank{r}/{pre|post}_{op}`,
mg_direction `{vpp}:{name}/rank{r}/mg_direction_{op}`), in `<out>/<rank directory name>/`; or
msprobe's csv2tensorboard layout (`<out>/rank{r}/{category}/`, tags `vp{vpp}:{name}[:micro{m}]/{op}`).
Values are written as float64 tensor scalars, which TensorBoard shows like any scalar and which
keep every digit of the CSV (`float32=True`: TensorBoard's classic 32-bit simple values, what
the live sink writes and what readers of `EventAccumulator.Scalars` expect).

TensorBoard -> CSV reads a rank directory with tensorboard's own EventAccumulator (nothing
sampled away; its restart handling drops what a resumed run superseded) and writes the CSV
files the live sink would have written: same names, header, row order, windows of
`step_count_per_record` steps and rounding to `ndigits` (both read from the rank's config.json
unless given). A run converted CSV -> TensorBoard -> CSV gives back its CSV files.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from ..output.csv_cell import csv_value
from ..output.layout import CONFIG_FILE, CSV_FILE, csv_file_name, format_tag
from ..output.records import COLLECTIVE_PHASES, MICRO_STEP_CATEGORIES, OTHER, TENSOR_CATEGORIES, DirectionKey
from ..resume import RANK_DIR, csv_windows, rank_dirs

logger = logging.getLogger("msmon")

FIXED_COLUMNS = ("vpp_stage", "name", "step", "micro_step")
# what the last part of a live tag, `{word}_{op}`, starts with: a category, mg_direction or a
# collective's phase; the longer words first, so that `exp_avg_sq_norm` is not exp_avg's `sq_norm`
TAG_WORDS = sorted((*TENSOR_CATEGORIES, DirectionKey.TASK, *COLLECTIVE_PHASES), key=len, reverse=True)
COLLECTIVE = re.compile(rf"^(?P<op>.+@.+)/(?P<phase>{'|'.join(COLLECTIVE_PHASES)})$")  # a collective's row name
MSMON_TAG = re.compile(r"^(?P<display>.+)/rank(?P<rank>\d+)/(?P<last>[^/]+)$")
MSPROBE_TAG = re.compile(r"^vp(?P<vpp>\d+):(?P<rest>.+)/(?P<op>[^/]+)$")
MSPROBE_RANK = re.compile(r"^rank(?P<rank>\d+)$")
LAYOUTS = ("msmon", "msprobe")
_META_KEY = "msmon"  # summary_description of a converted tag: its row, so reading it back needs no parsing

Progress = Callable[..., Any]  # tqdm-like: progress(total=, desc=, unit=, unit_scale=) -> object with update/close


@dataclass(frozen=True)
class RankSource:
    """One rank's output directory and the name of its counterpart in the output."""

    rank: int
    path: str
    name: str


@dataclass(frozen=True)
class Row:
    category: str
    vpp_stage: str
    name: str
    micro_step: str  # "" when the row has none


class ConvertError(ValueError):
    """Nothing to convert, or a place that cannot be written."""


# -- finding ranks ---------------------------------------------------------------------------------
def find_ranks(path: str, time_start: str | None = None, time_end: str | None = None) -> list[RankSource]:
    """The rank directories under `path` (a monitor output directory, or one rank directory)
    whose time prefix lies in [time_start, time_end]; msprobe's converted `rank{r}` folders too."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    match = RANK_DIR.match(base) or MSPROBE_RANK.match(base)
    if match:
        return [RankSource(int(match["rank"]), path, base)]
    time_range = [time_start, time_end] if (time_start or time_end) else None
    sources = [
        RankSource(rank, d, os.path.basename(d)) for rank, dirs in rank_dirs(path, time_range).items() for d in dirs
    ]
    if not sources and time_range is None:
        for name in sorted(os.listdir(path)):
            m = MSPROBE_RANK.match(name)
            if m and os.path.isdir(os.path.join(path, name)):
                sources.append(RankSource(int(m["rank"]), os.path.join(path, name), name))
    if not sources:
        raise ConvertError(
            f"no rank directory (<%b%d_%H-%M-%S>-rank<r>-<id>) under {path}"
            + (f" with a time prefix between {time_start} and {time_end}" if time_range else "")
        )
    return sorted(sources, key=lambda s: (s.rank, s.name))


def default_output(path: str, what: str) -> str:
    """`<monitor output>/<now>-<what>`, beside the rank directories (msprobe's default)."""
    path = os.path.abspath(path)
    if RANK_DIR.match(os.path.basename(path)) or MSPROBE_RANK.match(os.path.basename(path)):
        path = os.path.dirname(path)
    return os.path.join(path, f"{datetime.now().strftime('%b%d_%H-%M-%S')}-{what}")


def _fresh_dir(path: str) -> str:
    if os.path.isdir(path) and os.listdir(path):
        raise ConvertError(f"{path} exists and is not empty; choose another output directory")
    os.makedirs(path, exist_ok=True)
    return path


def _rank_config(directory: str) -> dict:
    try:
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


# -- tags ------------------------------------------------------------------------------------------
def msmon_tag(row: Row, rank: int) -> str:
    """The live TensorBoard sink's tag of a CSV row, without `_{op}`."""
    if row.category == OTHER:
        collective = COLLECTIVE.match(row.name)
        if collective:
            return f"{collective['op']}/rank{rank}/{collective['phase']}"
        return format_tag(f"{row.vpp_stage}:{row.name}", rank, DirectionKey.TASK)
    display = f"{row.vpp_stage}:{row.name}" + (f":{row.micro_step}" if row.micro_step != "" else "")
    return format_tag(display, rank, row.category)


def msprobe_tag(row: Row) -> str:
    """msprobe's csv2tensorboard tag, without `/{op}`."""
    return f"vp{row.vpp_stage}:{row.name}" + (f":micro{row.micro_step}" if row.micro_step != "" else "")


def parse_msmon_tag(tag: str) -> tuple[Row, str] | None:
    """(row, op) of a live msmon tag; None for tags that are no statistic of a row."""
    match = MSMON_TAG.match(tag)
    if not match:
        return None
    display, last = match["display"], match["last"]
    task, op = _split_task(last)
    if op is None:
        return None
    if task in COLLECTIVE_PHASES and "@" in display:
        return Row(OTHER, "0", f"{display}/{task}", ""), op
    vpp, sep, rest = display.partition(":")
    if not sep or not vpp.isdigit():
        return None
    if task == DirectionKey.TASK:
        return Row(OTHER, vpp, rest, ""), op
    micro = ""
    head, sep, tail = rest.rpartition(":")
    if sep and tail.isdigit():
        rest, micro = head, tail
    return Row(task, vpp, rest, micro), op


def _split_task(last: str) -> tuple[str, str | None]:
    for category in TAG_WORDS:
        if last.startswith(category + "_") and len(last) > len(category) + 1:
            return category, last[len(category) + 1 :]
    task, sep, op = last.rpartition("_")
    return (task, op) if sep and task else (last, None)


def parse_msprobe_tag(tag: str, category: str) -> tuple[Row, str] | None:
    match = MSPROBE_TAG.match(tag)
    if not match:
        return None
    rest, micro = match["rest"], ""
    head, sep, tail = rest.rpartition(":micro")
    if sep and tail.isdigit():
        rest, micro = head, tail
    return Row(category, match["vpp"], rest, micro), match["op"]


# -- CSV -> TensorBoard ----------------------------------------------------------------------------
def _lines(path: str, bar: Any) -> Iterator[str]:
    """The file's lines, advancing the progress bar by their size now and then."""
    done = 0
    with open(path, newline="", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            done += len(line)
            if i % 4096 == 4095:
                bar.update(done)
                done = 0
            yield line
    bar.update(done)


def read_csv_steps(path: str, bar: Any) -> Iterator[tuple[int, list[tuple[Row, list[tuple[str, float]]]]]]:
    """(step, [(row, [(op, value)])]) of one CSV window file, step by step in file order."""
    match = CSV_FILE.match(os.path.basename(path))
    if match is None:
        raise ConvertError(f"{path} is not a monitor CSV file (<category>_<first>-<last>.csv)")
    category = match["category"]
    reader = csv.reader(_lines(path, bar))
    header = next(reader, None)
    if not header or "step" not in header or "name" not in header:
        return
    column = {name: i for i, name in enumerate(header)}
    ops = [(i, name) for i, name in enumerate(header) if name not in FIXED_COLUMNS]
    step, rows = None, []
    for record in reader:
        if len(record) != len(header):
            continue
        this = int(record[column["step"]])
        if step is not None and this != step:
            yield step, rows
            rows = []
        step = this
        row = Row(
            category,
            record[column["vpp_stage"]] if "vpp_stage" in column else "0",
            record[column["name"]],
            record[column["micro_step"]] if "micro_step" in column else "",
        )
        rows.append((row, [(op, _float(record[i])) for i, op in ops if record[i] != ""]))
    if step is not None:
        yield step, rows


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


class _EventWriter:
    """An events file written with tensorboard's own writer; scalars as float64 tensors (or
    float32 simple values), each tag's first value carrying where it came from."""

    def __init__(self, directory: str, float32: bool) -> None:
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import DATA_CLASS_SCALAR, Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._metadata = Event, Summary, SummaryMetadata
        self._tensor, self._shape, self._double = TensorProto, TensorShapeProto, types_pb2.DT_DOUBLE
        self._scalar_class = DATA_CLASS_SCALAR
        self._writer = EventFileWriter(directory, max_queue_size=1024, flush_secs=30)
        self._float32 = float32
        self._seen: set[str] = set()
        self.values = 0

    def _value(self, tag: str, value: float, origin: list) -> Any:
        kwargs: dict[str, Any] = {"tag": tag}
        if tag not in self._seen:
            self._seen.add(tag)
            kwargs["metadata"] = self._metadata(
                plugin_data=self._metadata.PluginData(plugin_name="scalars"),
                data_class=self._scalar_class,
                summary_description=json.dumps({_META_KEY: origin}),
            )
        if self._float32:
            return self._summary.Value(simple_value=value, **kwargs)
        return self._summary.Value(
            tensor=self._tensor(dtype=self._double, tensor_shape=self._shape(), double_val=[value]), **kwargs
        )

    def write(self, step: int, values: list[tuple[str, float, list]]) -> None:
        if values:
            summary = self._summary(value=[self._value(tag, v, origin) for tag, v, origin in values])
            self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))
            self.values += len(values)

    def close(self) -> None:
        self._writer.close()


def csv_to_tensorboard(
    source: RankSource,
    output: str,
    layout: str = "msmon",
    float32: bool = False,
    categories: Iterable[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Convert one rank's CSV files; returns the number of values written."""
    if layout not in LAYOUTS:
        raise ConvertError(f"unknown tag layout {layout!r}; expected one of {list(LAYOUTS)}")
    wanted = set(categories) if categories else None
    files = [(path, m) for path, m in csv_windows(source.path) if wanted is None or m["category"] in wanted]
    files.sort(key=lambda item: (int(item[1]["first"]), int(item[1]["start"] or -1), item[1]["category"]))
    if not files:
        return 0
    total = sum(os.path.getsize(path) for path, _ in files)
    bar = (progress or _no_progress)(total=total, desc=f"rank {source.rank} csv->tb", unit="B", unit_scale=True)
    writers: dict[str, _EventWriter] = {}

    def writer_for(category: str) -> _EventWriter:
        key = category if layout == "msprobe" else ""
        if key not in writers:
            directory = (
                os.path.join(output, f"rank{source.rank}", category)
                if layout == "msprobe"
                else os.path.join(output, source.name)
            )
            writers[key] = _EventWriter(_fresh_dir(directory), float32)
        return writers[key]

    try:
        for path, match in files:
            writer = writer_for(match["category"])
            config = os.path.join(source.path, CONFIG_FILE)
            if layout == "msmon" and os.path.isfile(config):  # ndigits and step windows, for the way back
                target = os.path.join(output, source.name, CONFIG_FILE)
                if not os.path.exists(target):
                    shutil.copyfile(config, target)
            for step, rows in read_csv_steps(path, bar):
                values: list[tuple[str, float, list]] = []
                for row, cells in rows:
                    origin = [row.category, row.vpp_stage, row.name, row.micro_step]
                    if layout == "msprobe":
                        prefix = msprobe_tag(row)
                        values.extend((f"{prefix}/{op}", v, origin + [op]) for op, v in cells)
                    else:
                        prefix = msmon_tag(row, source.rank)
                        values.extend((f"{prefix}_{op}", v, origin + [op]) for op, v in cells)
                writer.write(step, values)
    finally:
        for writer in writers.values():
            writer.close()
        bar.close()
    return sum(w.values for w in writers.values())


# -- TensorBoard -> CSV ----------------------------------------------------------------------------
def _event_dirs(source: RankSource) -> list[tuple[str, str | None]]:
    """(directory holding events files, category it stands for or None) of a rank."""
    found = []
    for root, _dirs, names in os.walk(source.path):
        if any("tfevents" in n for n in names):
            rel = os.path.relpath(root, source.path)
            found.append((root, None if rel == "." else rel.split(os.sep)[0]))
    return sorted(found)


def read_tensorboard(directory: str) -> tuple[Any, list[str], list[str]]:
    """A loaded EventAccumulator (keeping every value) and its scalar and tensor tags; a corrupt
    record is skipped, with a warning, and the rest of its file read (sinks/event_reader.py)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    from .event_reader import tolerant_accumulator

    acc, source = tolerant_accumulator(
        directory,
        size_guidance={
            ea.SCALARS: 0,
            ea.TENSORS: 0,
            ea.HISTOGRAMS: 1,
            ea.IMAGES: 1,
            ea.AUDIO: 1,
            ea.COMPRESSED_HISTOGRAMS: 1,
        },
    )
    acc.Reload()
    for path, count in source.skipped.items():
        logger.warning("msmon: %s: %d corrupt record(s) skipped (checksum mismatch); the rest was read", path, count)
    tags = acc.Tags()
    return acc, list(tags.get(ea.SCALARS, [])), list(tags.get(ea.TENSORS, []))


def _origin(acc: Any, tag: str) -> tuple[Row, str] | None:
    try:
        described = json.loads(acc.SummaryMetadata(tag).summary_description or "{}")
    except (KeyError, ValueError, AttributeError):
        return None
    origin = described.get(_META_KEY) if isinstance(described, dict) else None
    if isinstance(origin, list) and len(origin) == 5 and all(isinstance(v, str) for v in origin):
        return Row(*origin[:4]), origin[4]
    return None


def _tensor_scalar(acc: Any, tag: str) -> bool:
    try:
        return acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
    except KeyError:
        return False


def collect_rows(
    source: RankSource, progress: Progress | None = None
) -> dict[str, dict[int, dict[Row, dict[str, float]]]]:
    """{category: {step: {row: {op: value}}}} of a rank's events, rows and ops in the order
    they were first written."""
    from tensorboard.util import tensor_util

    out: dict[str, dict[int, dict[Row, dict[str, float]]]] = {}
    for directory, category in _event_dirs(source):
        acc, scalar_tags, tensor_tags = read_tensorboard(directory)
        tensor_tags = [t for t in tensor_tags if _tensor_scalar(acc, t)]
        bar = (progress or _no_progress)(
            total=len(scalar_tags) + len(tensor_tags), desc=f"rank {source.rank} tb->csv", unit="tag"
        )
        for tag, events in [(t, acc.Scalars) for t in scalar_tags] + [(t, acc.Tensors) for t in tensor_tags]:
            bar.update(1)
            parsed = _origin(acc, tag)
            if parsed is None:
                parsed = parse_msprobe_tag(tag, category) if category else parse_msmon_tag(tag)
            if parsed is None:
                continue
            row, op = parsed
            steps = out.setdefault(row.category, {})
            for event in events(tag):
                value = event.value if hasattr(event, "value") else tensor_util.make_ndarray(event.tensor_proto).item()
                steps.setdefault(event.step, {}).setdefault(row, {})[op] = float(value)
        bar.close()
    return out


def tensorboard_to_csv(
    source: RankSource,
    output: str,
    steps_per_file: int | None = None,
    ndigits: int | None = None,
    progress: Progress | None = None,
) -> int:
    """Convert one rank's events; returns the number of CSV rows written."""
    config = _rank_config(source.path)
    window = steps_per_file or int(config.get("step_count_per_record", 1) or 1)
    digits = int(config.get("ndigits", 6)) if ndigits is None else ndigits
    data = collect_rows(source, progress)
    if not data:
        return 0
    directory = _fresh_dir(os.path.join(output, source.name))
    written = 0
    for category, steps in data.items():
        micro = category in MICRO_STEP_CATEGORIES or any(r.micro_step for rows in steps.values() for r in rows)
        current: tuple[str, tuple[str, ...]] | None = None
        fh = None
        writer = None
        try:
            for step in sorted(steps):
                for row, values in steps[step].items():
                    ops = tuple(values)
                    first = step // window * window
                    last = first + window - 1
                    base = csv_file_name(category, first, last)
                    if current is None or current[0] != base or current[1] != ops:
                        if fh is not None:
                            fh.close()
                        name = (
                            base
                            if current is None or current[0] != base
                            else csv_file_name(category, first, last, step)
                        )
                        path = os.path.join(directory, name)
                        fh = open(path, "a", newline="", encoding="utf-8")
                        writer = csv.writer(fh, lineterminator="\n")
                        if fh.tell() == 0:
                            writer.writerow(
                                ["vpp_stage", "name", "step"] + (["micro_step"] if micro else []) + list(ops)
                            )
                        current = (base, ops)
                    assert writer is not None  # opened with the first `current`
                    cells = [row.vpp_stage, row.name, str(step)] + ([row.micro_step] if micro else [])
                    writer.writerow(cells + [repr(csv_value(v, digits)) for v in values.values()])
                    written += 1
        finally:
            if fh is not None:
                fh.close()
    return written


def _no_progress(**_kwargs: Any) -> Any:
    class _Quiet:
        def update(self, _n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Quiet()
