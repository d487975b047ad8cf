"""A tensor's op over every step on both sides, for the page's charts: the rank where it parted
(rank by rank), the copies that parted (one value per tensor), or the order statistic that did."""

from __future__ import annotations

from .cells import Cell
from .compare import median, sortable
from .outcome import Series
from .table import SideRows


def series(cell: Cell, a: SideRows, b: SideRows) -> Series:
    steps = sorted({k[3] for k in a.rows if _same_tensor(k, cell)} | {k[3] for k in b.rows if _same_tensor(k, cell)})
    return Series(
        cell, steps, [_value(a, cell, s, cell.a_rank) for s in steps], [_value(b, cell, s, cell.rank) for s in steps]
    )


def _same_tensor(key: tuple, cell: Cell) -> bool:
    return key[0] == cell.category and key[1] == cell.vpp_stage and key[2] == cell.name


def _value(side: SideRows, cell: Cell, step: int, rank: int | None) -> float | None:
    if cell.statistic in ("rank", "tensor"):
        row = side.rows.get((cell.category, cell.vpp_stage, cell.name, step, cell.micro_step), {}).get(
            rank if rank is not None else -1
        )
        return _op(row, cell.op)
    pooled = [
        v
        for key, by_rank in side.rows.items()
        if _same_tensor(key, cell) and key[3] == step
        for row in by_rank.values()
        if (v := _op(row, cell.op)) is not None
    ]
    if not pooled:
        return None
    ordered = sorted(pooled, key=sortable)
    return {"min": ordered[0], "max": ordered[-1]}.get(cell.statistic, median(ordered))


def _op(row: tuple[tuple[str, ...], tuple[float, ...]] | None, op: str) -> float | None:
    if row is None or op not in row[0]:
        return None
    return row[1][row[0].index(op)]
