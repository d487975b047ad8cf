"""Rows with their own columns (L2 features, the loss, the gradient agreement) regrouped into
one record per category, on the writer thread.

A feature value travels in the step's one table like any statistic, as a row of its own
(RowKey.op names its column; the row is as wide as the step's ops, its value repeated). Here
those rows leave the statistics record and become, per category, rows with the category's
own columns (records.COLUMN_CATEGORIES): `attention_hook` rows `entropy, softmax_max`, and so
on. A module called several times in one micro-step gives the mean of its calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...records.rows import COLUMN_CATEGORIES, RowKey, StepRecord


def split_features(
    step: int, rank: int, keys: list[RowKey], table: torch.Tensor, meta: dict[str, Any]
) -> tuple[list[RowKey], torch.Tensor, list[StepRecord]]:
    """(statistic keys, their rows, one StepRecord per feature category present)."""
    feature_rows = [i for i, key in enumerate(keys) if key.op is not None]
    if not feature_rows:
        return keys, table, []
    values = table[feature_rows, 0].tolist()
    sums: dict[str, dict[RowKey, list[list[float]]]] = {}
    for i, value in zip(feature_rows, values):
        key = keys[i]
        columns = COLUMN_CATEGORIES[key.category][1]
        rows = sums.setdefault(key.category, {})
        base = dataclasses.replace(key, op=None)
        acc = rows.get(base)
        if acc is None:
            acc = rows[base] = [[0.0] * len(columns), [0] * len(columns)]
        j = columns.index(key.op)
        acc[0][j] += value
        acc[1][j] += 1
    records = []
    for category, rows in sums.items():
        table_rows = [[s / n if n else float("nan") for s, n in zip(*acc)] for acc in rows.values()]
        records.append(
            StepRecord(
                step=step,
                rank=rank,
                ops=list(COLUMN_CATEGORIES[category][1]),
                keys=list(rows),
                values=table_rows,
                meta=meta,
                table=torch.tensor(table_rows, dtype=torch.float64),
            )
        )
    taken = set(feature_rows)
    kept = [i for i in range(len(keys)) if i not in taken]
    return [keys[i] for i in kept], table[kept], records
