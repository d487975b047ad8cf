"""CSV -> TensorBoard: one rank's CSV window files to an events file (or msprobe's layout)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ...output.resume import csv_windows
from ...records.layout import CONFIG_FILE, CSV_FILE
from .sources import ConvertError, Progress, RankSource, fresh_dir, no_progress
from .tags import LAYOUTS, META_KEY, Row, msmon_tag, msprobe_tag

FIXED_COLUMNS = ("vpp_stage", "name", "step", "micro_step")


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
                summary_description=json.dumps({META_KEY: origin}),
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
    """Convert one rank's CSV files; returns the number of values written. `layout` "by_rank":
    the tags of tensorboard_layout by_rank (no rank in the tag; the summary lanes are the live
    sink's alone, not written here)."""
    if layout not in LAYOUTS:
        raise ConvertError(f"unknown tag layout {layout!r}; expected one of {list(LAYOUTS)}")
    wanted = set(categories) if categories else None
    files = [(path, m) for path, m in csv_windows(source.path) if wanted is None or m["category"] in wanted]
    files.sort(key=lambda item: (int(item[1]["first"]), int(item[1]["start"] or -1), item[1]["category"]))
    if not files:
        return 0
    total = sum(os.path.getsize(path) for path, _ in files)
    bar = (progress or no_progress)(total=total, desc=f"rank {source.rank} csv->tb", unit="B", unit_scale=True)
    writers: dict[str, _EventWriter] = {}

    def writer_for(category: str) -> _EventWriter:
        key = category if layout == "msprobe" else ""
        if key not in writers:
            directory = (
                os.path.join(output, f"rank{source.rank}", category)
                if layout == "msprobe"
                else os.path.join(output, source.name)
            )
            writers[key] = _EventWriter(fresh_dir(directory), float32)
        return writers[key]

    try:
        for path, match in files:
            writer = writer_for(match["category"])
            config = os.path.join(source.path, CONFIG_FILE)
            if layout != "msprobe" and os.path.isfile(config):  # ndigits and step windows, for the way back
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
                        prefix = msmon_tag(row, None if layout == "by_rank" else source.rank)
                        values.extend((f"{prefix}_{op}", v, origin + [op]) for op, v in cells)
                writer.write(step, values)
    finally:
        for writer in writers.values():
            writer.close()
        bar.close()
    return sum(w.values for w in writers.values())
