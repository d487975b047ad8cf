"""Small DuckDB helpers shared by the loaders and the report queries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


def one_row(result: DuckDBPyConnection) -> tuple[Any, ...]:
    """The row of a query that always returns exactly one (an aggregate, an INSERT's count)."""
    row = result.fetchone()
    if row is None:
        raise RuntimeError("an aggregate query returned no row")
    return row
