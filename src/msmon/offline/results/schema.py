"""The database's tables and views, in one place (docs/results.md describes them for users).

One long view holds every statistic of every rank: `metrics(rank, vpp_stage, category, name,
step, micro_step, op, value, file_id)`, a row per value: the rows copied from CSV files and
TensorBoard scalars (the table `loaded_metrics`; `files.kind` says which file) and the run's
Parquet files, read where they are (parquet_catalog.py: the view is a catalog, not a copy). The
other tables keep what is not a statistic row: histograms, anomaly records in training order,
each monitor's summary and config, and the files loaded (what makes a re-run incremental).

Version 2 renamed version 1's `metrics` table to `loaded_metrics` (a version 1 database is
brought up to date when `msmon db` adds to it, and read as it is by `msmon report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...anomaly.event import EVENT_FIELDS
from ...stats.ops import OPS, TABLE  # noqa: F401 (OPS: tb_loader and queries import it from here)
from .sql import one_row

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection

SCHEMA_VERSION = "2"
READABLE_VERSIONS = ("1", SCHEMA_VERSION)  # what `msmon report` reads: both have `metrics`

FILE_COLUMNS = [
    ("id", "INTEGER"),
    ("path", "VARCHAR"),
    ("kind", "VARCHAR"),
    ("rank", "INTEGER"),
    ("rank_dir", "VARCHAR"),
    ("category", "VARCHAR"),
    ("size", "BIGINT"),
    ("mtime_ns", "BIGINT"),
    ("loaded_bytes", "BIGINT"),
    ("records", "BIGINT"),
    ("header", "VARCHAR"),
    ("tail", "VARCHAR"),
    ("loaded_at", "TIMESTAMP"),
]
METRIC_COLUMNS = [
    ("rank", "INTEGER"),
    ("vpp_stage", "INTEGER"),
    ("category", "VARCHAR"),
    ("name", "VARCHAR"),
    ("step", "BIGINT"),
    ("micro_step", "INTEGER"),
    ("op", "VARCHAR"),
    ("value", "DOUBLE"),
    ("file_id", "INTEGER"),
]
HISTOGRAM_COLUMNS = [
    ("rank", "INTEGER"),
    ("vpp_stage", "INTEGER"),
    ("category", "VARCHAR"),
    ("name", "VARCHAR"),
    ("step", "BIGINT"),
    ("edges", "DOUBLE[]"),
    ("counts", "DOUBLE[]"),
    ("file_id", "INTEGER"),
]
# one row per tensor: `position` is its line in the monitor's files (the order the monitor
# recorded it in a step: execution order for activations)
TENSOR_COLUMNS = [("category", "VARCHAR"), ("vpp_stage", "INTEGER"), ("name", "VARCHAR"), ("position", "BIGINT")]
CONFIG_COLUMNS = [
    ("rank", "INTEGER"),
    ("rank_dir", "VARCHAR"),
    ("format", "VARCHAR"),
    ("ops", "VARCHAR"),
    ("config", "VARCHAR"),
    ("file_id", "INTEGER"),
]
SUMMARY_KEYS = (
    "steps_recorded",
    "alerts",
    "first_nonfinite",
    "monitor_seconds",
    "steps_timed",
    "step_ms",
    "monitor_ms_per_step",
    "monitor_cost_pct",
    "writer_cpu_seconds",
    "writer_cpu_ms_per_step",
    "last_step",
)

ANOMALY_COLUMNS = [
    ("seq", "INTEGER"),
    *((f.name, f.sql_type) for f in EVENT_FIELDS),
    ("description", "VARCHAR"),  # msmon analyse's line about it
    ("file", "VARCHAR"),  # the dump it was read from
]


def _columns(columns: list[tuple[str, str]]) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in columns)


TABLES = {
    "meta": "key VARCHAR, value VARCHAR",
    "files": _columns(FILE_COLUMNS),
    "loaded_metrics": _columns(METRIC_COLUMNS),  # the rows copied from CSV and TensorBoard
    "tensors": _columns(TENSOR_COLUMNS),
    "histograms": _columns(HISTOGRAM_COLUMNS),
    # an anomaly record's fields (anomaly/event.py), in training order (`seq`, msmon analyse's)
    "anomalies": _columns(ANOMALY_COLUMNS),
    "summaries": (
        "rank INTEGER, rank_dir VARCHAR, steps_recorded BIGINT, alerts BIGINT, first_nonfinite VARCHAR, "
        "monitor_seconds DOUBLE, steps_timed BIGINT, step_ms DOUBLE, monitor_ms_per_step DOUBLE, "
        "monitor_cost_pct DOUBLE, writer_cpu_seconds DOUBLE, writer_cpu_ms_per_step DOUBLE, "
        "last_step BIGINT, summary VARCHAR, file_id INTEGER"
    ),
    "configs": _columns(CONFIG_COLUMNS),
}

# `metrics` before any Parquet file is known (parquet_catalog.define_metrics replaces it)
LOADED_ONLY = f"SELECT {', '.join(name for name, _ in METRIC_COLUMNS)} FROM loaded_metrics"
_WIDE_OPS = ",\n  ".join(f"max(value) FILTER (WHERE op = '{op.column}') AS {op.column}" for op in TABLE)

VIEWS = {
    # micro-steps of a step combined: min of mins, mean of means, the largest of the rest
    "step_values": """
SELECT rank, vpp_stage, category, name, step, op,
  CASE op WHEN 'min' THEN min(value) WHEN 'mean' THEN avg(value) ELSE max(value) END AS value,
  count(*) AS micro_steps
FROM metrics GROUP BY rank, vpp_stage, category, name, step, op""",
    # the CSV layout again: one row per tensor and (micro-)step, a column per op
    "metrics_wide": f"""
SELECT rank, vpp_stage, category, name, step, micro_step,
  {_WIDE_OPS}
FROM metrics GROUP BY rank, vpp_stage, category, name, step, micro_step""",
    # one tensor name on several ranks at the same (micro-)step: how far apart the values are
    "rank_spread": """
SELECT category, vpp_stage, name, step, micro_step, op, count(*) AS ranks,
  min(value) AS min_value, max(value) AS max_value, max(value) - min(value) AS spread,
  (max(value) - min(value)) / greatest(abs(max(value)), abs(min(value)), 1e-30) AS rel_spread,
  arg_min(rank, value) AS min_rank, arg_max(rank, value) AS max_rank
FROM metrics WHERE isfinite(value)
GROUP BY category, vpp_stage, name, step, micro_step, op HAVING count(*) > 1""",
    "anomaly_timeline": """
SELECT seq, rank, step, micro_step, stage, pp_stage, vpp_stage, call_id, rule, category, name, op, value, history,
  description
FROM anomalies ORDER BY seq""",
    "monitor_cost": """
SELECT rank, rank_dir, steps_recorded, alerts, step_ms, monitor_ms_per_step, monitor_cost_pct,
  writer_cpu_ms_per_step, monitor_seconds
FROM summaries ORDER BY rank""",
    "ranks": """
SELECT rank, rank_dir, count(*) FILTER (WHERE kind = 'csv') AS csv_files,
  count(*) FILTER (WHERE kind = 'tensorboard') AS tensorboard_files,
  count(*) FILTER (WHERE kind = 'parquet') AS parquet_files,
  sum(size) AS bytes, max(loaded_at) AS last_loaded
FROM files WHERE kind IN ('csv', 'tensorboard', 'parquet', 'summary', 'config')
GROUP BY rank, rank_dir ORDER BY rank, rank_dir""",
}


def _tables(con: DuckDBPyConnection) -> set[str]:
    return {
        row[0]
        for row in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
        ).fetchall()
    }


def _version(con: DuckDBPyConnection, tables: set[str]) -> str | None:
    """The msmon schema version the database holds; None when msmon did not write it."""
    if "meta" not in tables:
        return None
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except Exception:  # a `meta` of someone else's, without those columns
        return None
    return None if row is None else str(row[0])


def _refuse_other(version: str | None, readable: tuple[str, ...] = (SCHEMA_VERSION,)) -> None:
    if version is not None and version not in readable:
        raise SchemaError(
            f"the database has schema version {version}, this msmon writes {SCHEMA_VERSION}: write a new database file"
        )


def require_msmon(con: DuckDBPyConnection, path: str) -> None:
    """A database to read (msmon report) must be one msmon db wrote, in this schema version."""
    version = _version(con, _tables(con))
    if version is None:
        raise SchemaError(
            f"{path} is a DuckDB database, but not one msmon db wrote (it has no msmon schema_version); "
            f"make one with: msmon db -d <monitor output> -o <new file>"
        )
    _refuse_other(version, READABLE_VERSIONS)


def create(con: DuckDBPyConnection) -> None:
    """Create what is missing; an existing database of another schema version is refused, and
    so is one with tables that msmon did not write (its views could replace the owner's)."""
    existing = _tables(con)
    version = _version(con, existing)
    others = existing - set(TABLES) - set(VIEWS) - {"metrics", "parquet_metrics"}
    # msmon's names, `meta` among them, and no version yet: msmon's own creation, cut short
    if version is None and existing and (others or "meta" not in existing):
        shown = sorted(others or existing)
        raise SchemaError(
            f"the database holds tables msmon did not write ({', '.join(shown[:3])}"
            f"{' ...' if len(shown) > 3 else ''}); give msmon db a new file"
        )
    if version == "1":  # its `metrics` table is version 2's loaded_metrics; the view takes the name
        con.execute("ALTER TABLE metrics RENAME TO loaded_metrics")
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [SCHEMA_VERSION])
        version = SCHEMA_VERSION
    _refuse_other(version)
    for name, columns in TABLES.items():
        con.execute(f"CREATE TABLE IF NOT EXISTS {name} ({columns})")
    con.execute(f"CREATE VIEW IF NOT EXISTS metrics AS {LOADED_ONLY}")
    for name, query in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {query}")
    if one_row(con.execute("SELECT count(*) FROM meta WHERE key = 'schema_version'"))[0] == 0:
        con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [SCHEMA_VERSION])


class SchemaError(Exception):
    """The database file is not one this msmon can add to."""
