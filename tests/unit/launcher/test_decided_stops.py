"""Stops msmon decides end like decisions: each rank's record in the bootstrap directory, one rule
that picks among several, the launcher's line and exit code, and msmon's exit-code table kept
the same in code and in docs/launcher.md. The whole path on real torchrun ranks is in
tests/e2e/test_runs_and_nan_stop.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from conftest import ROOT
from msmon.launcher.run_summary import summary_lines
from msmon.system import decision as decisions
from msmon.system.decision import Decision, choose, read_decisions, record
from msmon.system.exit_codes import EXIT_CODES, JOB_FAULT_STOP, NONFINITE_STOP, RANK_FAULT_STOP
from msmon.system.stop import StopOnNan, stop_on_nan


def test_a_record_is_written_whole_into_the_bootstrap_directory_and_read_back(tmp_path):
    made = Decision(NONFINITE_STOP, "msmon: the job stopped after step 4", 4, 1, [1])
    path = record(made, str(tmp_path))
    assert path is not None and os.path.dirname(path) == str(tmp_path / decisions.DECISIONS_DIR)
    assert os.listdir(tmp_path / decisions.DECISIONS_DIR) == [os.path.basename(path)]  # no temporary file left
    (tmp_path / decisions.DECISIONS_DIR / "torn.json").write_text('{"code": 3, "li')  # a rank killed mid-write
    (tmp_path / decisions.DECISIONS_DIR / "odd.json").write_text('{"code": "3", "line": "x", "step": 1, "rank": 0}')
    assert read_decisions(str(tmp_path)) == [made]


def test_without_a_launcher_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv("MSMON_BOOTSTRAP_DIR", raising=False)
    assert record(Decision(NONFINITE_STOP, "x", 0, 0)) is None
    assert record(Decision(NONFINITE_STOP, "x", 0, 0), str(tmp_path / "gone")) is None


def test_the_earliest_step_then_the_highest_precedence_then_the_lowest_rank_is_the_jobs_decision():
    later = Decision(JOB_FAULT_STOP, "later", 9, 0)
    nonfinite = Decision(NONFINITE_STOP, "nan", 5, 0)
    one_rank = [Decision(RANK_FAULT_STOP, "rank", 5, r) for r in (3, 2)]
    everyone = Decision(JOB_FAULT_STOP, "all", 5, 7)
    assert choose([]) is None
    assert choose([later, nonfinite]) is nonfinite  # the earliest step first, whatever its code
    assert choose([nonfinite, *one_rank]) is one_rank[1]  # 16 over 3 at the same step; then rank 2 before 3
    assert choose([nonfinite, *one_rank, everyone]) is everyone  # 17 over 16
    assert choose([Decision(99, "a newer msmon's", 5, 0), nonfinite]) is nonfinite  # unknown codes rank last


def test_the_launcher_prints_the_decisions_line_after_the_first_non_finite_value(tmp_path):
    log_dir = tmp_path / "Dec01_10-00-00-rank0-aaaaaaaa"
    log_dir.mkdir()
    (log_dir / "summary.json").write_text(
        json.dumps(
            {
                "steps_recorded": 4,
                "alerts": 2,
                "first_nonfinite": {"step": 3, "rank": 0, "stage": "forward", "tensor": "fc.output"},
            }
        )
    )
    monitor = {"rank": 0, "log_dir": str(log_dir), "output_base": str(tmp_path), "optimizer": "AdamW"}
    made = Decision(NONFINITE_STOP, "msmon: the job stopped after step 3 as alert.on_nan asks", 3, 0, [0])
    lines = summary_lines([{"rank": 0, "monitors": [monitor]}], "run", str(tmp_path), "r1", decision=made)
    origin = next(i for i, line in enumerate(lines) if "first non-finite value" in line)
    assert lines[origin + 1] == made.line and lines.count(made.line) == 1
    assert lines[-1].startswith("msmon: run r1; next:")


def test_a_rank_stopping_without_the_launcher_says_the_line_itself_and_exits_3(capsys, monkeypatch):
    monkeypatch.delenv("MSMON_BOOTSTRAP_DIR", raising=False)
    closed = []
    with pytest.raises(StopOnNan) as stopped:
        stop_on_nan(1, 7, [0, 1], lambda: closed.append("monitor"), lambda: closed.append("others"))
    assert stopped.value.code == NONFINITE_STOP and closed == ["monitor", "others"]
    assert capsys.readouterr().out == (
        "msmon[rank 1]: the job stopped after step 7 as alert.on_nan asks: non-finite statistics on ranks 0, 1 "
        "(exit code 3); the output and the anomaly dump are complete\n"
    )


def test_a_rank_under_the_launcher_records_before_waiting_for_the_others_and_prints_nothing(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("MSMON_BOOTSTRAP_DIR", str(tmp_path))
    seen_when_waiting = []
    with pytest.raises(StopOnNan):
        stop_on_nan(0, 2, [1], lambda: None, lambda: seen_when_waiting.extend(read_decisions(str(tmp_path))))
    assert [(d.code, d.step, d.rank, d.ranks) for d in seen_when_waiting] == [(NONFINITE_STOP, 2, 0, [1])]
    assert capsys.readouterr().out == ""


def test_the_exit_code_table_in_docs_launcher_md_is_the_one_in_code():
    text = (ROOT / "docs" / "launcher.md").read_text()
    section = text[text.index("## Exit codes") :]
    rows = re.findall(r"^\| (\d+) \| (\w+) \| (.+) \|$", section, re.M)
    documented = {int(code): (name, meaning.replace("`", "")) for code, name, meaning in rows}
    assert documented == {c.code: (c.name, c.meaning.replace("`", "")) for c in EXIT_CODES.values()}
