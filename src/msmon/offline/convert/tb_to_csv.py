"""TensorBoard -> CSV: one rank's events back to the CSV files the live sink would have written."""

from __future__ import annotations

import csv
import json
import logging
import os
from typing import Any

from ...records.csv_cell import count_value, csv_value
from ...records.layout import csv_file_name, tags_by_rank
from ...records.rows import MICRO_STEP_CATEGORIES
from ...stats.ops import COUNT_OPS
from ..event_reader import tolerant_accumulator
from .sources import Progress, RankSource, fresh_dir, no_progress, rank_config
from .tags import META_KEY, Row, parse_msmon_tag, parse_msprobe_tag

logger = logging.getLogger("msmon")


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
    origin = described.get(META_KEY) if isinstance(described, dict) else None
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
    layout = rank_config(source.path).get("tensorboard_layout")
    for directory, category in _event_dirs(source):
        acc, scalar_tags, tensor_tags = read_tensorboard(directory)
        tensor_tags = [t for t in tensor_tags if _tensor_scalar(acc, t)]
        # the layout the rank wrote (its config.json), else what its tags show: a tag alone cannot tell
        by_rank = layout == "by_rank" if layout else tags_by_rank(scalar_tags + tensor_tags)
        bar = (progress or no_progress)(
            total=len(scalar_tags) + len(tensor_tags), desc=f"rank {source.rank} tb->csv", unit="tag"
        )
        for tag, events in [(t, acc.Scalars) for t in scalar_tags] + [(t, acc.Tensors) for t in tensor_tags]:
            bar.update(1)
            parsed = _origin(acc, tag)
            if parsed is None:
                parsed = parse_msprobe_tag(tag, category) if category else parse_msmon_tag(tag, by_rank)
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
    config = rank_config(source.path)
    window = steps_per_file or int(config.get("step_count_per_record", 1) or 1)
    digits = int(config.get("ndigits", 6)) if ndigits is None else ndigits
    data = collect_rows(source, progress)
    if not data:
        return 0
    directory = fresh_dir(os.path.join(output, source.name))
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
                    writer.writerow(
                        cells
                        + [
                            repr(count_value(v) if op in COUNT_OPS else csv_value(v, digits))
                            for op, v in values.items()
                        ]
                    )
                    written += 1
        finally:
            if fh is not None:
                fh.close()
    return written
