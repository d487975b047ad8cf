"""`msmon db` and `msmon report` refuse a database path that is not theirs, in one line and with
a non-zero exit, and leave the file as it was."""

from __future__ import annotations

import json

import duckdb
from click.testing import CliRunner

from msmon.launcher.cli import main  # noqa: E402


def foreign_database(path) -> None:
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE sales (id INTEGER, amount DOUBLE)")
    con.execute("CREATE VIEW ranks AS SELECT 1 AS mine")  # a name msmon uses for a view of its own
    con.execute("INSERT INTO sales VALUES (1, 2.5)")
    con.close()


def test_msmon_db_refuses_an_existing_file_that_is_not_a_database_and_leaves_it_as_it_was(tmp_path):
    (tmp_path / "out").mkdir()
    existing = tmp_path / "existing.csv"
    existing.write_text("step,loss\n0,1.5\n")
    result = CliRunner().invoke(main, ["db", "-d", str(tmp_path / "out"), "-o", str(existing)])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        f"Error: {existing} exists and is not a DuckDB database (msmon db writes one, msmon report reads one); "
        "name a new file or a database msmon db wrote"
    ]
    assert existing.read_text() == "step,loss\n0,1.5\n"


def test_msmon_db_refuses_a_duckdb_database_holding_other_tables_and_changes_none_of_them(tmp_path):
    (tmp_path / "out").mkdir()
    database = tmp_path / "sales.duckdb"
    foreign_database(database)
    result = CliRunner().invoke(main, ["db", "-d", str(tmp_path / "out"), "-o", str(database)])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "Error: the database holds tables msmon did not write (sales); give msmon db a new file"
    ]
    con = duckdb.connect(str(database), read_only=True)
    tables = con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()
    assert tables == [("ranks",), ("sales",)]
    assert con.execute("SELECT * FROM ranks").fetchall() == [(1,)]
    con.close()


def test_msmon_report_on_a_duckdb_database_that_is_not_msmons_says_so_in_one_line(tmp_path):
    database = tmp_path / "sales.duckdb"
    foreign_database(database)
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", "--db", str(database), "-o", str(page)])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert result.output.strip().splitlines() == [
        f"Error: {database} is a DuckDB database, but not one msmon db wrote (it has no msmon schema_version); "
        "make one with: msmon db -d <monitor output> -o <new file>"
    ]
    assert not page.exists()


def test_a_database_msmon_db_made_is_still_brought_up_to_date_and_reported(tmp_path):
    rank_dir = tmp_path / "out" / "Dec06_00-00-00-rank0-0a1b2c3d"
    rank_dir.mkdir(parents=True)
    (rank_dir / "summary.json").write_text(json.dumps({"rank": 0, "steps_recorded": 0, "note": "no step ran"}))
    database = tmp_path / "run.duckdb"
    for _ in range(2):  # made, then brought up to date
        result = CliRunner().invoke(main, ["db", "-d", str(tmp_path / "out"), "-o", str(database)])
        assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["report", "--db", str(database), "-o", str(tmp_path / "report.html")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").stat().st_size > 0
