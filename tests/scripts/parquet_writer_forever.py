"""Writes steps through msmon's Parquet sink until it is killed (tests/unit/sinks/test_parquet_sink.py
kills it with SIGKILL mid-write): small row groups, so that the open file holds row groups
without the footer that a closed file ends with, and a new file every 3 steps."""

from __future__ import annotations

import sys

import torch

from msmon.output.sinks.parquet_sink import ParquetSink
from msmon.records.rows import RowKey, StepRecord


def main() -> None:
    output_base, rank = sys.argv[1], int(sys.argv[2])
    sink = ParquetSink(output_base, "killed-run", 6, 3, 128 << 20, row_group_rows=64)
    keys = [RowKey("grad_reduced", f"layers.{i}.weight") for i in range(20)]
    step = 0
    while True:
        table = torch.rand(len(keys), 4, dtype=torch.float64) * (step + 1)
        sink.write(StepRecord(step, rank, ["norm", "min", "max", "mean"], keys, table=table))
        step += 1


if __name__ == "__main__":
    main()
