"""`category_ops`: a category's rows keep only its own ops in the output (msprobe V2's per-monitor
ops); the statistics are computed once for `ops`, and each category's columns are cut on the
writer thread."""

from __future__ import annotations

import pytest
import torch

from msmon.config import ConfigError, parse_config
from msmon.config.schema import STATISTIC_CATEGORIES
from msmon.output.category_ops import CategoryColumns
from msmon.records.rows import OTHER, TENSOR_CATEGORIES, RowKey, StepRecord


def test_the_configs_categories_are_the_records_statistic_categories():
    assert STATISTIC_CATEGORIES == (*TENSOR_CATEGORIES, OTHER)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"category_ops": {"activations": ["norm"]}}, "category_ops: unknown category 'activations'"),
        ({"category_ops": {"actv": ["norm", "median"]}}, "category_ops.actv: unknown op 'median'"),
        ({"category_ops": {"actv": []}}, "category_ops.actv: expected at least one op"),
        ({"category_ops": ["actv"]}, "category_ops: expected an object {category: [ops]}"),
        ({"ops": ["norm"], "category_ops": {"actv": ["max"]}}, "category_ops.actv: ['max'] not in ops ['norm']"),
    ],
)
def test_a_category_ops_mistake_is_one_line_naming_the_key(cfg, message):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert str(err.value).startswith(message)


def test_each_category_keeps_its_own_columns_with_the_values_of_the_whole_row():
    keys = [RowKey("actv", "fc1.output"), RowKey("grad_reduced", "fc1.weight"), RowKey("actv", "fc2.output")]
    ops = ["norm", "min", "max"]
    table = torch.arange(9, dtype=torch.float64).reshape(3, 3)
    record = StepRecord(3, 0, ops, keys, histograms=[("h", [0.0, 1.0], [2.0])], table=table)
    parts = CategoryColumns({"actv": ["max", "norm"]}).split(record)
    assert [(p.ops, [k.name for k in p.keys]) for p in parts] == [
        (["norm", "max"], ["fc1.output", "fc2.output"]),  # in the order of `ops`
        (["norm", "min", "max"], ["fc1.weight"]),
    ]
    assert parts[0].values == [[0.0, 2.0], [6.0, 8.0]] and parts[1].values == [[3.0, 4.0, 5.0]]
    assert parts[0].histograms and not parts[1].histograms and {p.step for p in parts} == {3}
    assert CategoryColumns({}).split(record) == [record]
    assert CategoryColumns({"exp_avg": ["norm"]}).split(record) == [record]  # no row of it: nothing to cut
