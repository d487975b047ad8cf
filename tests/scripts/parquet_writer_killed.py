"""Writes steps through msmon's Parquet sink until it is killed (tests/unit/sinks/test_parquet_sink.py
and benchmarks/parquet_scale.py kill it with SIGKILL): a file every 3 steps, row groups of one
step. Once two files are closed and the third holds row groups, it says `open` on stdout and
goes on writing into that third file (step 7 again and again, so that it never closes): the
kill lands while it writes, whenever it comes."""

from __future__ import annotations

import sys

import torch

from msmon.output.sinks.parquet_sink import ParquetSink
from msmon.records.rows import RowKey, StepRecord

TENSORS, OPS = 20, ["norm", "min", "max", "mean"]


def main() -> None:
    output_base, rank = sys.argv[1], int(sys.argv[2])
    sink = ParquetSink(output_base, "killed-run", 6, 3, 128 << 20, row_group_rows=TENSORS * len(OPS))
    keys = [RowKey("grad_reduced", f"layers.{i}.weight") for i in range(TENSORS)]
    step = 0
    while True:
        table = torch.rand(TENSORS, len(OPS), dtype=torch.float64) * (step + 1)
        sink.write(StepRecord(min(step, 7), rank, OPS, keys, table=table))
        if step == 7:  # steps 0-2 and 3-5 closed, 6 and 7 written as row groups of the open file
            print("open", flush=True)
        step += 1


if __name__ == "__main__":
    main()
