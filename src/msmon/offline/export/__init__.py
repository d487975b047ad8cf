"""`msmon export --to parquet`: an earlier run's CSV files as the `parquet` format's dataset
(records/parquet_layout.py), so that `msmon db` reads it in place and any Parquet engine can.
Torch-free; needs pyarrow (`pip install 'msmon[parquet]'`)."""
