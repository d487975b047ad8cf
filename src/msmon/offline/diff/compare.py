"""The two sides' rows set against each other, as layout.py says for each category: rank by
rank, one value per tensor (every copy on one side against every copy on the other), or the
min, median and max over the ranks and micro-steps of a step. Each pair of rows goes to
Findings with its ops' relative differences."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from .cells import Cell
from .findings import Findings
from .layout import RANK, TENSOR, Layout
from .table import NO_MICRO, RowKey, SideRows
from .tolerance import differences

Values = tuple[float, ...]
ManyCopies = 16  # more distinct copies of a whole tensor than this: its per-op extremes stand for them


def compare(a: SideRows, b: SideRows, layout: Layout, findings: Findings) -> None:
    pooled: dict[str, list[RowKey]] = defaultdict(list)
    for key in sorted(a.rows.keys() | b.rows.keys()):
        mode = layout.mode(key[0])
        counted = layout.not_counted(key[0]) is None
        if mode == RANK:
            _rank_by_rank(key, a.rows.get(key, {}), b.rows.get(key, {}), counted, findings)
        elif mode == TENSOR:
            _one_value(key, a.rows.get(key, {}), b.rows.get(key, {}), counted, findings)
        else:
            pooled[key[0]].append(key)
    for category, keys in pooled.items():
        _order_statistics(keys, a, b, layout.not_counted(category) is None, findings)


def _common(ops_a: tuple[str, ...], ops_b: tuple[str, ...]) -> tuple[list[str], list[int], list[int]]:
    if ops_a == ops_b:
        index = list(range(len(ops_a)))
        return list(ops_a), index, index
    shared = [op for op in ops_a if op in ops_b]
    return shared, [ops_a.index(op) for op in shared], [ops_b.index(op) for op in shared]


def _maker(key: RowKey, statistic: str, rank: int | None, a_rank: int | None) -> Callable[..., Cell]:
    category, vpp, name, step, micro = key

    def make(op: str, x: float, y: float, rel: float, limit: float) -> Cell:
        return Cell(step, micro, category, vpp, name, op, statistic, rank, a_rank, x, y, rel, limit)

    return make


def _pair(
    key: RowKey,
    statistic: str,
    rank: int | None,
    a_rank: int | None,
    row_a: tuple[tuple[str, ...], Values],
    row_b: tuple[tuple[str, ...], Values],
    counted: bool,
    findings: Findings,
) -> None:
    ops, ia, ib = _common(row_a[0], row_b[0])
    va = [row_a[1][i] for i in ia] if ia != list(range(len(row_a[1]))) else list(row_a[1])
    vb = [row_b[1][i] for i in ib] if ib != list(range(len(row_b[1]))) else list(row_b[1])
    rel = differences(ops, va, vb)
    findings.compare_row(_maker(key, statistic, rank, a_rank), key[:3], key[3], ops, va, vb, rel, counted)


def _rank_by_rank(key: RowKey, ra: dict, rb: dict, counted: bool, findings: Findings) -> None:
    for rank in sorted(ra.keys() | rb.keys()):
        if rank not in rb:
            findings.only_a[key[0]] += 1
        elif rank not in ra:
            findings.only_b[key[0]] += 1
        else:
            _pair(key, "rank", rank, rank, ra[rank], rb[rank], counted, findings)


def _one_value(key: RowKey, ra: dict, rb: dict, counted: bool, findings: Findings) -> None:
    """Every distinct copy on one side against every distinct copy on the other; the pair
    farthest apart (by its largest op) is the one recorded."""
    if not ra or not rb:
        (findings.only_a if ra else findings.only_b)[key[0]] += 1
        return
    copies_a, copies_b = _copies(ra), _copies(rb)
    best: tuple[float, int, int] | None = None
    for rank_a, row_a in copies_a:
        for rank_b, row_b in copies_b:
            ops, ia, ib = _common(row_a[0], row_b[0])
            rel = differences(ops, [row_a[1][i] for i in ia], [row_b[1][i] for i in ib])
            worst = max(rel, default=0.0)
            if best is None or worst > best[0]:
                best = (worst, rank_a, rank_b)
    assert best is not None
    _, rank_a, rank_b = best
    _pair(key, "tensor", rank_b, rank_a, ra[rank_a], rb[rank_b], counted, findings)


def _copies(by_rank: dict) -> list[tuple[int, tuple[tuple[str, ...], Values]]]:
    """One (rank, row) per distinct row, the lowest rank holding it; beyond ManyCopies, the rows
    holding each op's extremes."""
    seen: dict[tuple, int] = {}
    for rank in sorted(by_rank):
        seen.setdefault((by_rank[rank][0], tuple(repr(v) for v in by_rank[rank][1])), rank)
    ranks = sorted(seen.values())
    if len(ranks) > ManyCopies:
        width = len(by_rank[ranks[0]][1])
        extremes: set[int] = set()
        for i in range(width):
            ordered = sorted(ranks, key=lambda r: sortable(by_rank[r][1][i] if i < len(by_rank[r][1]) else 0.0))
            extremes.update((ordered[0], ordered[-1]))
        ranks = sorted(extremes)
    return [(rank, by_rank[rank]) for rank in ranks]


def sortable(value: float) -> tuple[bool, float]:
    return (value != value, value if value == value else 0.0)


def _order_statistics(keys: list[RowKey], a: SideRows, b: SideRows, counted: bool, findings: Findings) -> None:
    """Rows of a step pooled over ranks and micro-steps; min, median and max of each op compared."""
    pools_a, pools_b = _pools(keys, a), _pools(keys, b)
    for pool_key in sorted(pools_a.keys() | pools_b.keys()):
        if pool_key not in pools_b or pool_key not in pools_a:
            (findings.only_a if pool_key in pools_a else findings.only_b)[pool_key[0]] += 1
            continue
        (ops_a, rows_a), (ops_b, rows_b) = pools_a[pool_key], pools_b[pool_key]
        stats_a, stats_b = _stats(ops_a, rows_a), _stats(ops_b, rows_b)
        key: RowKey = (*pool_key, NO_MICRO)
        for statistic in ("min", "median", "max"):
            _pair(
                key, statistic, None, None, (ops_a, stats_a[statistic]), (ops_b, stats_b[statistic]), counted, findings
            )


def _pools(keys: list[RowKey], side: SideRows) -> dict[tuple[str, int, str, int], tuple[tuple[str, ...], list[Values]]]:
    pools: dict[tuple[str, int, str, int], tuple[tuple[str, ...], list[Values]]] = {}
    for key in keys:
        for ops, values in side.rows.get(key, {}).values():
            pool = pools.setdefault(key[:4], (ops, []))
            if ops == pool[0]:
                pool[1].append(values)
    return pools


def _stats(ops: Sequence[str], rows: list[Values]) -> dict[str, Values]:
    columns = [sorted((row[i] for row in rows), key=sortable) for i in range(len(ops))]
    middle = [median(c) for c in columns]
    return {"min": tuple(c[0] for c in columns), "median": tuple(middle), "max": tuple(c[-1] for c in columns)}


def median(column: list[float]) -> float:
    n = len(column)
    return column[n // 2] if n % 2 else (column[n // 2 - 1] + column[n // 2]) / 2
