"""The report's values read from the run's Parquet files with pyarrow, placed in numpy as they
are decoded: what DuckDB's read of the `metrics` view cost most of a report of 512 ranks was
not the decoding but handing every value and its computed place to Python, and matching every
name to its tensor. Here a file's names, categories and ops arrive dictionary-encoded
(`read_dictionary`): a name is matched once per dictionary entry, and a value's place is a few
array operations on codes.

Each file is read once, in a thread pool (pyarrow and numpy let go of the GIL), for a group of
steps of every category at a time: the groups follow the files' own step ranges (their footers'
statistics), as many steps as GROUP_CELLS holds, so that a file is read once when its steps fit
(a group that holds fewer steps than a file, past a few thousand ranks at 100 steps a file,
reads the file once per group it meets).
A group's values go straight into one array per category (value_window.settle makes the
windows). Used only where every value the report folds lies in the Parquet files (no CSV or
TensorBoard rows loaded for them) and pyarrow is installed; a value written twice at one place
(which value_window.place layers) sends the fold back to DuckDB's read (`Repeated`), a value
the plan has no place for raises Unplaced, as there.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ...records.parquet_layout import SPANS_KEY, widened
from .parquet_catalog import SOURCES_KEY
from .value_plan import ValuePlan
from .value_window import Unplaced, Window, Workspace, settle

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

GROUP_CELLS = 1 << 27  # cells of one group of steps, every category: 1 GiB of float64 at most
COLUMNS = ["rank", "vpp_stage", "category", "name", "step", "micro_step", "op", "value"]
CODED = ["category", "name", "op"]  # read as dictionary codes
UNPLACED = -(1 << 60)  # a place term of a row the plan has no place for: its sum stays negative


class Repeated(Exception):
    """A value written twice at one place: DuckDB's read, which keeps both, is used instead."""


def parquet_files(con: DuckDBPyConnection, excluded: str) -> list[str] | None:
    """The Parquet files that hold every value outside the categories `excluded`, when the
    `metrics` view reads them and nothing else there (and pyarrow is installed); else None."""
    import duckdb

    try:
        import pyarrow.parquet  # noqa: F401  (the `parquet` extra)
    except ImportError:
        return None
    try:
        row = con.execute("SELECT value FROM meta WHERE key = ?", [SOURCES_KEY]).fetchone()
        loaded = con.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM loaded_metrics WHERE category NOT IN ({excluded}) LIMIT 1)"
        ).fetchone()
    except duckdb.Error:  # no `meta` or `loaded_metrics`: not a database msmon db made
        return None
    if not row or loaded is None or loaded[0]:
        return None
    files: list[str] = []
    for source in json.loads(row[0]):  # a run folder's glob, or a file (parquet_catalog.define_metrics)
        files += [source] if os.path.isfile(source) else sorted(glob.glob(source))
    return files or None


@dataclass
class _Span:
    """A file, the steps its rows hold (None: unknown, read with every group) and the columns
    that hold one value in all its rows (from the statistics: not read)."""

    path: str
    first: int | None
    last: int | None
    constant: dict[str, int]
    categories: dict[str, list[int]] | None  # SPANS_KEY: category -> steps and micro-steps; None: not written

    def meets(self, first: int, last: int) -> bool:
        return self.first is None or self.last is None or (self.first <= last and self.last >= first)


def _span(path: str) -> _Span:
    import pyarrow.parquet as pq

    meta = pq.read_metadata(path)
    names = meta.schema.names
    bounds: dict[str, tuple[Any, Any]] = {}
    for column in ("step", "rank", "vpp_stage"):
        if column not in names:
            continue
        j, lo, hi = names.index(column), None, None
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(j).statistics
            if stats is None or not stats.has_min_max or stats.null_count:
                lo = hi = None
                break
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
        bounds[column] = (lo, hi)
    first, last = bounds.pop("step", (None, None))
    constant = {c: int(lo) for c, (lo, hi) in bounds.items() if lo is not None and lo == hi}
    written = (meta.metadata or {}).get(SPANS_KEY.encode())
    return _Span(path, first, last, constant, json.loads(written) if written else None)


def _groups(plan: ValuePlan, spans: list[_Span]) -> list[tuple[int, int]]:
    """(first step, last step) of each group: ends where a file's steps end when one fits."""
    first, last = plan.first_step, plan.last_step
    if first is None or last is None:
        return []
    per_step = sum(c.cells_per_step(len(plan.ranks), len(plan.ops)) for c in plan.categories)
    span = max(1, GROUP_CELLS // max(1, per_step))
    starts = sorted({s.first for s in spans if s.first is not None})
    out = []
    while first <= last:
        ends = [b - 1 for b in starts if first < b <= first + span]
        end = min(max(ends) if ends else first + span - 1, last)
        out.append((first, end))
        first = end + 1
    return out


@dataclass
class _Block:
    """Category `index`'s part of a group: steps first..last, from `offset` of the group's arrays."""

    index: int
    first: int
    last: int
    offset: int
    size: int

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


class _Codes:
    """What the strings and numbers of the rows mean in the plan: category, op, tensor and rank
    slots. Arrays indexed by category slot have one more entry, for rows of no category the
    plan folds (`none`)."""

    def __init__(self, plan: ValuePlan) -> None:
        self.plan = plan
        self.none = len(plan.categories)
        self.category = {c.name: i for i, c in enumerate(plan.categories)}
        self.op = {op: i for i, op in enumerate(plan.ops)}
        self.name: dict[str, int] = {}
        for c in plan.categories:
            for _, name in c.tensors:
                self.name.setdefault(name, len(self.name))
        stages = sorted({vpp for c in plan.categories for vpp, _ in c.tensors}) or [0]
        self.stage0, self.stages = stages[0], stages[-1] - stages[0] + 2  # the last: a stage no tensor has
        # tensor[category, stage, name]: the tensor's slot in its category, -1 where none (the last
        # category: rows of none the plan folds; the last stage and name: unknown ones)
        self.tensor = np.full((self.none + 1, self.stages, len(self.name) + 1), -1, dtype=np.int64)
        for i, c in enumerate(plan.categories):
            for t, (vpp, name) in enumerate(c.tensors):
                self.tensor[i, vpp - self.stage0, self.name[name]] = t
        self.rank = {rank: slot for slot, rank in enumerate(plan.ranks)}
        self.rank0 = min(plan.ranks, default=0)
        # rank_slot[rank - rank0]: the rank's slot (-1: a rank the plan lacks; the last entry: any rank outside)
        self.rank_slot = np.full(max(plan.ranks, default=0) - self.rank0 + 2, -1, dtype=np.int64)
        for rank, slot in self.rank.items():
            self.rank_slot[rank - self.rank0] = slot

    def stage(self, vpp: np.ndarray | int) -> np.ndarray:
        at = np.asarray(vpp, dtype=np.int64) - self.stage0
        return np.where((at >= 0) & (at < self.stages - 1), at, self.stages - 1)

    def ranks(self, rank: np.ndarray) -> np.ndarray:
        """Each row's rank slot, -1 for a rank the plan lacks."""
        at = rank - self.rank0
        return self.rank_slot[np.where((at >= 0) & (at < self.rank_slot.size), at, -1)]


class _Axes:
    """One group's blocks as arrays indexed by category slot: the first step `lo`, the steps
    `S` (0: no block), the first micro-step `m0`, micro-steps `M`, and the strides."""

    def __init__(self, codes: _Codes, blocks: list[_Block]) -> None:
        plan, n = codes.plan, codes.none + 1
        ops = len(plan.ops)
        self.lo, self.m0 = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self.S, self.M = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
        tensor_stride = np.zeros(n, dtype=np.int64)  # cells of a tensor: S x M
        self.op_stride = np.zeros(n, dtype=np.int64)  # of an op: tensors x S x M
        self.offset = np.zeros(n, dtype=np.int64)
        for b in blocks:
            c, i = plan.categories[b.index], b.index
            self.lo[i], self.m0[i], self.offset[i] = b.first, c.first_micro, b.offset
            self.S[i], self.M[i] = b.steps, c.micro
            tensor_stride[i] = b.steps * c.micro
            self.op_stride[i] = len(c.tensors) * b.steps * c.micro
        self.rank_stride = self.op_stride * ops
        # a tensor's first cell in its category's block (UNPLACED: no such tensor)
        self.tensor = np.where(codes.tensor >= 0, codes.tensor * tensor_stride[:, None, None], UNPLACED)


def _indices(array: Any, missing: int) -> np.ndarray:
    """A dictionary array's codes, `missing` for a null (Array.to_numpy costs a millisecond a
    call here; the buffer is the same)."""
    indices = array.indices
    if indices.null_count:
        import pyarrow.compute as pc

        return pc.fill_null(indices, missing).to_numpy()
    width = indices.type.bit_width // 8
    return np.frombuffer(indices.buffers()[1], dtype=f"<i{width}", count=len(indices), offset=indices.offset * width)


def _table(array: Any, meaning: dict[str, int], missing: int) -> np.ndarray:
    """The meaning of each entry of a dictionary array's dictionary, and of a null (the last)."""
    return np.array([meaning.get(s, missing) for s in array.dictionary.to_pylist()] + [missing], dtype=np.int64)


def _numbers(array: Any, missing: int) -> np.ndarray:
    """An integer column's values as a new int64 array, `missing` for a null (read from the
    buffers: Array.to_numpy and fill_null cost more here than the copy)."""
    width = array.type.bit_width // 8
    out = np.frombuffer(array.buffers()[1], dtype=f"<i{width}", count=len(array), offset=array.offset * width)
    out = out.astype(np.int64)
    if array.null_count:
        bits = np.frombuffer(array.buffers()[0], dtype=np.uint8)
        valid = np.unpackbits(bits, count=array.offset + len(array), bitorder="little")[array.offset :]
        np.copyto(out, missing, where=valid == 0)
    return out


class ParquetWindows:
    """The value windows of a plan, read from `files` a group of steps at a time."""

    def __init__(self, files: list[str], threads: int | None = None) -> None:
        self.threads = threads or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(self.threads) as pool:
            self.spans = list(pool.map(_span, files))

    def category_spans(self) -> list[tuple[str, int, int, int, int]] | None:
        """(category, first step, last step, first micro-step, last micro-step) over every file,
        from the footers; None when a file does not say (written before msmon wrote SPANS_KEY)."""
        out: dict[str, list[int]] = {}
        for span in self.spans:
            if span.categories is None:
                return None
            for category, got in span.categories.items():
                out[category] = widened(out.get(category), got)
        return [(c, v[0], v[1], v[2], v[3]) for c, v in sorted(out.items())]

    def windows(self, plan: ValuePlan, space: Workspace) -> Iterator[tuple[int, Window, bool]]:
        """(category index, window, whether it is the category's last) for every category and
        group of steps, in step order within a category."""
        codes = _Codes(plan)
        groups = _groups(plan, self.spans)
        last_group = {
            i: max(g for g, (first, last) in enumerate(groups) if c.first_step <= last and c.last_step >= first)
            for i, c in enumerate(plan.categories)
        }
        ranks, ops = len(plan.ranks), len(plan.ops)
        for g, (first, last) in enumerate(groups):
            blocks, offset = [], 0
            for i, c in enumerate(plan.categories):
                lo, hi = max(first, c.first_step), min(last, c.last_step)
                if lo > hi:
                    continue
                size = c.cells_per_step(ranks, ops) * (hi - lo + 1)
                blocks.append(_Block(i, lo, hi, offset, size))
                offset += size
            value = space.take("group_value", offset, np.float64)
            present = space.take("group_present", offset, np.bool_)
            present.fill(False)
            axes = _Axes(codes, blocks)
            files = [s for s in self.spans if s.meets(first, last)]
            with ThreadPoolExecutor(self.threads) as pool:
                place = partial(_place_file, codes=codes, axes=axes, value=value, present=present)
                placed = sum(pool.map(place, files))
            if int(np.count_nonzero(present)) < placed:
                raise Repeated(f"steps {first}..{last}")
            for block in blocks:
                c = plan.categories[block.index]
                part = slice(block.offset, block.offset + block.size)
                written = int(np.count_nonzero(present[part]))
                shape = (ops, len(c.tensors), block.steps, c.micro)
                window = settle(space, c.name, block.first, plan.ranks, shape, 1, value[part], present[part], written)
                yield block.index, window, last_group[block.index] == g


def _place_file(span: _Span, codes: _Codes, axes: _Axes, value: np.ndarray, present: np.ndarray) -> int:
    """Place the values of one file that fall in the group; how many were placed."""
    import pyarrow.parquet as pq

    columns = [c for c in COLUMNS if c not in span.constant]
    table = pq.ParquetFile(span.path, read_dictionary=CODED).read(columns=columns, use_threads=False)
    placed = 0
    for batch in table.to_batches():
        col = dict(zip(columns, batch.columns))
        placed += _place_batch(col, span, codes, axes, value, present)
    return placed


def _place_batch(
    col: dict[str, Any], span: _Span, codes: _Codes, axes: _Axes, value: np.ndarray, present: np.ndarray
) -> int:
    """Place one record batch's values. Everything that depends on a row's category, op and name
    is looked up in one small table indexed by the batch's own dictionary codes: where the cells
    of that (category, op, tensor) start on the rank (UNPLACED where the plan has no place)."""
    kinds = _table(col["category"], codes.category, codes.none)  # per category code: its slot
    op_slot = _table(col["op"], codes.op, -1)
    name_slot = _table(col["name"], codes.name, len(codes.name))
    rank, vpp = span.constant.get("rank"), span.constant.get("vpp_stage")
    c, o = kinds[:, None, None], op_slot[None, :, None]
    starts = np.where(o >= 0, o * axes.op_stride[c], UNPLACED) + axes.offset[c]
    if rank is not None:  # a rank the plan lacks: no place, should a row of it be kept
        slot = codes.rank.get(rank)
        starts = starts + (UNPLACED if slot is None else slot * axes.rank_stride[c])
    if vpp is not None:
        starts = starts + axes.tensor[c, int(codes.stage(vpp)), name_slot[None, None, :]]
    else:  # the tensor is added row by row, with its stage
        starts = np.broadcast_to(starts, (kinds.size, op_slot.size, name_slot.size))
    shape = starts.shape
    # int64 codes: numpy gathers with an int32 index convert it first, every time
    category = _indices(col["category"], shape[0] - 1).astype(np.int64)
    key = category * shape[1]
    key += _indices(col["op"], shape[1] - 1)
    key *= shape[2]
    key += _indices(col["name"], shape[2] - 1)
    lo, steps, m0, micro = axes.lo[kinds], axes.S[kinds], axes.m0[kinds], axes.M[kinds]
    # the plan's categories among the batch's rows (the last entry of `kinds` is a null's)
    listed = kinds if col["category"].null_count else kinds[:-1]
    folded = listed[listed != codes.none]
    s = _numbers(col["step"], -1)
    if folded.size == listed.size > 0 and np.ptp(axes.lo[folded]) == 0 and np.ptp(axes.S[folded]) == 0:
        s = s - lo[0]  # every row in one block of steps: no gather
        keep = s.view(np.uint64) < steps[0]
    else:
        s = s - lo[category]
        keep = s.view(np.uint64) < steps[category]
    m = _numbers(col["micro_step"], -1)
    if m0.any():  # else every category of the batch starts at micro-step 0
        m -= m0[category]
    keep &= m.view(np.uint64) < micro[category]
    if col["value"].null_count:
        keep &= ~col["value"].is_null().to_numpy(zero_copy_only=False)
    x = col["value"].to_numpy(zero_copy_only=False)
    rank_slots = None if rank is not None else codes.ranks(_numbers(col["rank"], -1))
    stage = None if vpp is not None else codes.stage(_numbers(col["vpp_stage"], codes.stage0 - 1))
    if not keep.all():
        picked = np.flatnonzero(keep)
        if not picked.size:
            return 0
        category, key, s, m, x = category[picked], key[picked], s[picked], m[picked], x[picked]
        rank_slots = None if rank_slots is None else rank_slots[picked]
        stage = None if stage is None else stage[picked]
    at = starts.ravel()[key]
    if rank_slots is not None:
        if rank_slots.min() < 0:
            raise Unplaced(span.path)
        at += rank_slots * axes.rank_stride[kinds[category]]
    if stage is not None:
        at += axes.tensor[kinds[category], stage, name_slot[key % shape[2]]]
    if (axes.M[folded] == 1).all():  # the rows kept: no category of the batch has micro-steps
        at += s
    else:
        at += s * micro[category].astype(np.int64)
    at += m
    if at.min() < 0:  # an op or tensor the plan lacks
        raise Unplaced(span.path)
    value[at] = x
    present[at] = True
    return int(at.size)
