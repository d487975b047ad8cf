"""`msmon diff`: two runs side by side, the first step and tensor, in training order, where they
part (docs/diff.md). Torch-free; duckdb only to read a database or Parquet files, or write `--db`.

    source.py            what a side is: its facts, its chunks of rows
    inputs.py            `open_input`: the reader of the path given
    directory_source.py  an output directory (msmon's runs, msprobe's layout)
    parquet_source.py    its Parquet files: per run and rank, unfinished and damaged ones said
    database_source.py   a database `msmon db` wrote
    golden.py            golden files: what --calibrate writes, read back as side A
    reading.py           both sides read; byte-identical file pairs counted, not parsed
    csv_rows.py          a CSV file's rows, or its rows counted
    parquet_rows.py      a rank's Parquet files' rows; both sides' joined, the same rows counted
    table.py             one side's rows in memory, keyed for alignment
    names.py             --map: A's names rewritten into B's
    layout.py            how each category is compared (rank by rank, one value, order statistics)
    tolerance.py         relative differences per op, the floor, the three modes
    compare.py           rows set against each other
    cells.py             one compared value
    findings.py          what a comparison found as it goes (first divergence, front, per tensor)
    order.py             training order within a step
    interpret.py         what the first divergence implies, in one line
    contract.py          what the runs are, side by side; a different model refused
    calibrate.py         --calibrate: the tolerance learnt from reruns
    outcome.py           the answer, read by every output
    terminal.py, json_report.py, duckdb_table.py, html_page.py, series.py   the outputs
    command.py           `msmon diff A B` itself: exit 0, 1 or 2
"""
