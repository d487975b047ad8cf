"""After the run: every rank's output in one DuckDB database (`msmon db`), and an HTML report
built from it (`msmon report`).

    scan.py         find and classify what the monitors wrote (CSV, TensorBoard, Parquet, dumps, JSON)
    schema.py       the tables and views, created and documented in one place
    bulk.py         rows into DuckDB through one CSV file per batch (fast, no pandas/arrow)
    csv_loader.py   msmon's CSV files, appended rows only on a re-run
    tb_loader.py    TensorBoard event files, read with tensorboard's own loader
    connection.py   opening the database (duckdb imported only there)
    db.py           `msmon db`: load directories into a database
    loader.py       the incremental load: which files are new, grown or changed
    parquet_catalog.py  Parquet files cataloged, not copied: the `metrics` view reads them in place
    load_report.py  what a load did, and its progress bar
    queries.py      what the report shows, as SQL over the database (limits.py: its bounds)
    anomaly_queries.py  the report's anomaly section, msmon analyse's verdict
    report_html.py  the self-contained page (inline CSS/JS from static/)

duckdb is an optional dependency (`pip install 'msmon[db]'`); nothing here is imported by the
monitor itself.
"""
