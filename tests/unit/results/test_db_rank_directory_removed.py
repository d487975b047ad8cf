"""`msmon db` on an output directory from which a rank directory is removed while it loads (a
cleanup job, a move to other storage): the other ranks are loaded, the removed one is skipped
with one line, and a later load brings it in when it is back. The removal is made to happen at
the worst moment: right after the real scan has listed the directory's files."""

from __future__ import annotations

import json
import shutil

import duckdb
from click.testing import CliRunner

from msmon.launcher.cli import main  # noqa: E402
from msmon.offline.results import loader  # noqa: E402
from msmon.output.sinks.tensorboard_sink import TensorBoardSink  # noqa: E402
from msmon.records.rows import RowKey, StepRecord  # noqa: E402


def rank_dir(out, rank: int):
    path = out / f"Dec01_10-00-00-rank{rank}-abcdef0{rank}"
    path.mkdir(parents=True)
    for step in (0, 1):
        (path / f"grad_reduced_{step}-{step}.csv").write_text(f"vpp_stage,name,step,norm\n0,w,{step},{rank + 1.5}\n")
    (path / "summary.json").write_text(json.dumps({"rank": rank, "steps_recorded": 2, "alerts": 0}))
    sink = TensorBoardSink(str(path))
    sink.write(
        StepRecord(step=0, rank=rank, ops=["norm"], keys=[RowKey("actv", "fc.output", micro_step=0)], values=[[2.0]])
    )
    sink.close()
    return path


def test_a_rank_directory_removed_during_the_load_is_skipped_with_one_line(tmp_path, monkeypatch):
    out = tmp_path / "out"
    kept, removed = rank_dir(out, 0), rank_dir(out, 1)
    aside = tmp_path / "aside"
    real_scan = loader.scan

    def scan_then_the_directory_goes(root: str):
        found = real_scan(root)
        shutil.move(str(removed), str(aside))
        return found

    monkeypatch.setattr(loader, "scan", scan_then_the_directory_goes)
    database = tmp_path / "run.duckdb"
    result = CliRunner().invoke(main, ["db", "-d", str(out), "-o", str(database), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    said = [line for line in result.output.splitlines() if str(removed) in line]
    assert said == [
        f"msmon db: {removed} disappeared during the load; 4 of its files skipped (load again to bring it in)"
    ]
    con = duckdb.connect(str(database), read_only=True)
    assert con.execute("SELECT DISTINCT rank FROM metrics ORDER BY 1").fetchall() == [(0,)]
    assert con.execute("SELECT count(*) FROM files WHERE rank_dir = ?", [str(removed)]).fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM files WHERE rank_dir = ?", [str(kept)]).fetchone() == (4,)
    con.close()

    monkeypatch.setattr(loader, "scan", real_scan)
    shutil.move(str(aside), str(removed))  # back: the next load brings it in
    again = CliRunner().invoke(main, ["db", "-d", str(out), "-o", str(database), "--no-progress"])
    assert again.exit_code == 0, again.output
    con = duckdb.connect(str(database), read_only=True)
    assert con.execute(
        "SELECT rank, step, value FROM metrics WHERE category = 'grad_reduced' ORDER BY 1, 2"
    ).fetchall() == [
        (0, 0, 1.5),
        (0, 1, 1.5),
        (1, 0, 2.5),
        (1, 1, 2.5),
    ]
    con.close()
