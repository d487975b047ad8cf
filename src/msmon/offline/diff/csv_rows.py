"""msmon's CSV files (and msprobe's: the same layout) read for a comparison.

A file is `vpp_stage,name,step[,micro_step],<value columns>`, one line per tensor and
(micro-)step, in the order the monitor recorded them. Only complete lines are read: a last
line without its newline is still being written (or was cut by a crash) and is left out, as
`msmon db` leaves it. Any other line that does not fit the header makes the file corrupt:
DiffInputError names the file and the line.
"""

from __future__ import annotations

import csv
import os
from collections import Counter
from typing import NamedTuple

from ...records.layout import CSV_FILE
from .errors import DiffInputError
from .table import NO_MICRO, Counted, Row

KEYS = ("vpp_stage", "name", "step")
MICRO = "micro_step"


def columns(header: str, path: str) -> tuple[bool, tuple[str, ...]]:
    """(has a micro_step column, the value columns) of a header; DiffInputError when it is not
    msmon's layout."""
    names = header.split(",")
    if tuple(names[:3]) != KEYS or len(names) < 4 or len(set(names)) != len(names):
        raise DiffInputError(f"{path}: not msmon's CSV layout (header {header[:80]!r})")
    micro = names[3] == MICRO
    values = tuple(names[4:] if micro else names[3:])
    if not values:
        raise DiffInputError(f"{path}: the header names no statistic ({header[:80]!r})")
    return micro, values


def complete_lines(data: bytes) -> bytes:
    """`data` up to its last newline: a line still being written is left out."""
    end = data.rfind(b"\n")
    return data[: end + 1] if end >= 0 else b""


def parse(data: bytes, path: str, rank: int, category: str) -> list[Row]:
    """Every complete line of the file as a Row; DiffInputError for a line that does not fit."""
    text = complete_lines(data).decode("utf-8", "replace")
    lines = text.split("\n")
    if not lines or not lines[0]:
        return []
    micro, ops = columns(lines[0].rstrip("\r"), path)
    width = 3 + micro + len(ops)
    rows: list[Row] = []
    positions: dict[tuple[int, int], int] = {}
    for number, line in enumerate(lines[1:], 2):
        line = line.rstrip("\r")
        if not line:
            continue
        cells = line.split(",") if '"' not in line else next(csv.reader([line]))
        if len(cells) != width:
            raise DiffInputError(f"{path} line {number}: {len(cells)} cells where the header has {width}")
        try:
            vpp, step = int(cells[0]), int(cells[2])
            micro_step = int(cells[3]) if micro and cells[3] != "" else NO_MICRO
            values = tuple(float(c) for c in cells[3 + micro :])
        except ValueError:
            raise DiffInputError(f"{path} line {number}: not a number where one is expected: {line[:100]!r}") from None
        place = (step, micro_step)
        position = positions.get(place, 0)
        positions[place] = position + 1
        rows.append(Row(category, vpp, cells[1], step, micro_step, rank, ops, values, position))
    return rows


class FileCount(NamedTuple):
    """A file's rows told without their values: how many, the `vpp,name` cells, rows per step."""

    rows: int
    values: int
    names: set[tuple[bytes, bytes]]  # (b"0", b"layers.0.fc1.weight")
    per_step: dict[int, int]


def count(data: bytes, path: str, category: str) -> FileCount:
    """What a file covers, its values unread. A file of one step (msmon's default, one step per
    file: its name says `{category}_{s}-{s}.csv`) has its step from its name; any other's steps
    are read from its lines."""
    data = complete_lines(data)
    cut = data.find(b"\n")
    if cut < 0:
        return FileCount(0, 0, set(), {})
    _micro, ops = columns(data[:cut].decode("utf-8", "replace").rstrip("\r"), path)
    body = data[cut + 1 :]
    rows = body.count(b"\n")
    width = len(ops) + 3 + (data[:cut].count(b",micro_step,") > 0)
    window = CSV_FILE.match(os.path.basename(path))
    one_step = window is not None and window["first"] == window["last"]
    if (
        one_step
        and body.startswith(b"0,")
        and body.count(b"\n0,") == rows - 1
        and body.count(b",") == rows * (width - 1)
        and b'"' not in body
    ):  # every line whole, pipeline chunk 0, one step (msmon's default): the names, sliced out in C
        names = {(b"0", name) for name in body.split(b",")[1 :: width - 1]}
        return FileCount(rows, rows * len(ops), names, {int(window["first"]): rows})  # type: ignore[index]
    parsed = parse(data, path, 0, category)  # anything else: line by line, and a bad line is named
    return FileCount(
        len(parsed),
        len(parsed) * len(ops),
        {(b"%d" % r.vpp_stage, r.name.encode()) for r in parsed},
        dict(Counter(r.step for r in parsed)),
    )


def counted(category: str, files: list[FileCount]) -> Counted:
    """The files of one category of one rank, together."""
    out = Counted()
    names: set[tuple[bytes, bytes]] = set()
    for f in files:
        out.rows += f.rows
        out.values += f.values
        names |= f.names
        for step, rows in f.per_step.items():
            out.per_step[(step, category)] += rows
    out.steps = {step for step, _ in out.per_step}
    for vpp, name in names:
        out.tensors.add((category, int(vpp), name.decode("utf-8", "replace")))
    return out
