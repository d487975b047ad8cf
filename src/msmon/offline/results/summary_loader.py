"""summary.json and config.json of each rank into `summaries`, `configs` and `actions`.

`actions` holds what alert.actions did, one row per escalation (its first and last step) and
per skipped step, read from summary.json's `escalations` and `skipped_steps`: the report draws
them as bands over the charts, and a query can leave the escalated steps out or keep only them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from .bulk import insert_rows
from .load_report import LoadReport
from .scan import SUMMARY, FoundFile
from .schema import ACTION_COLUMNS, CONFIG_COLUMNS, SUMMARY_KEYS

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


class Loader(Protocol):
    """What loading the JSON files needs of the load under way (loader.py's Loader, which calls
    `load_json`: named by this protocol, not imported, so that no import closes a circle)."""

    con: DuckDBPyConnection
    report: LoadReport
    tmp_dir: str | None

    def id_for(self, f: FoundFile) -> int: ...

    def file_row(
        self, f: FoundFile, file_id: int, loaded_bytes: int, records: int, rank: int | None = None
    ) -> tuple: ...

    def upsert_files(self, rows: list[tuple]) -> None: ...


def load_json(loader: Loader, items: list[tuple[FoundFile, bool, int]]) -> None:
    """Load the summaries and configs `items` name (each replaces what its file gave before)."""
    if not items:
        return
    con = loader.con
    summaries, configs, actions, files = [], [], [], []
    for f, _reload, _ in items:
        file_id = loader.id_for(f)
        try:
            with open(f.path, encoding="utf-8") as fh:
                text = fh.read()
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:  # removed since the scan
            loader.report.vanished(f.rank_dir)
            continue
        except (OSError, ValueError) as exc:
            loader.report.problems.append(f"{f.path}: cannot be read ({exc}); skipped")
            continue
        rank = data.get("rank") if f.kind == SUMMARY and isinstance(data.get("rank"), int) else f.rank
        if f.kind == SUMMARY:
            values = [data.get(k) for k in SUMMARY_KEYS]
            values[2] = None if values[2] is None else json.dumps(values[2])
            summaries.append(
                (rank, f.rank_dir, *[_number(v) if i != 2 else v for i, v in enumerate(values)], text, file_id)
            )
            actions += action_rows(rank, f.rank_dir, data, file_id)
        else:
            configs.append((rank, f.rank_dir, _joined(data.get("format")), _joined(data.get("ops")), text, file_id))
        files.append(loader.file_row(f, file_id, f.size, 1, rank))
    con.begin()
    try:
        ids = [r[0] for r in files]
        for table in ("summaries", "configs", "actions"):
            con.execute(f"DELETE FROM {table} WHERE file_id IN (SELECT unnest(?::INTEGER[]))", [ids])
        insert_rows(
            con,
            "summaries",
            [("rank", "INTEGER"), ("rank_dir", "VARCHAR")]
            + [(k, "VARCHAR" if k == "first_nonfinite" else "DOUBLE") for k in SUMMARY_KEYS]
            + [("summary", "VARCHAR"), ("file_id", "INTEGER")],
            summaries,
            loader.tmp_dir,
        )
        insert_rows(con, "configs", CONFIG_COLUMNS, configs, loader.tmp_dir)
        insert_rows(con, "actions", ACTION_COLUMNS, actions, loader.tmp_dir)
        loader.upsert_files(files)
        con.commit()
    except BaseException:
        con.rollback()
        raise


def action_rows(rank: int | None, rank_dir: str, summary: dict[str, Any], file_id: int) -> list[tuple]:
    """The `actions` rows of one summary.json: its escalations and its skipped steps."""
    rows: list[tuple] = []
    for e in summary.get("escalations") or []:
        if isinstance(e, dict) and isinstance(e.get("first_step"), int) and isinstance(e.get("last_step"), int):
            keys = ",".join(str(k) for k in e.get("keys") or [])
            rows.append(
                (rank, rank_dir, "escalate", e["first_step"], e["last_step"], e.get("alert_step"), e.get("action"),
                 e.get("why"), keys, file_id)
            )  # fmt: skip
    for s in summary.get("skipped_steps") or []:
        if isinstance(s, dict) and isinstance(s.get("step"), int):
            rows.append(
                (
                    rank,
                    rank_dir,
                    "skip_step",
                    s["step"],
                    s["step"],
                    s["step"],
                    s.get("action"),
                    s.get("why"),
                    "",
                    file_id,
                )
            )
    return rows


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _joined(value: Any) -> str | None:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value if isinstance(value, str) else None
