"""output/artifacts.py: a collector's side file is written whole or not at all, with exactly the
bytes of its text, and a failed write never costs the file written before."""

from __future__ import annotations

import os

import pytest

from msmon.output.artifacts import write_artifact


def test_a_side_file_holds_exactly_the_texts_utf8_bytes_with_newlines_untranslated(tmp_path):
    text = 'module_name,stack_info\r\n0:fc1,"File a.py, line 3, in f, \n x = 1 \n"\nnaïve,é\n'
    path = write_artifact(str(tmp_path), "stack_info.csv", text)
    assert path == os.path.join(str(tmp_path), "stack_info.csv")
    assert (tmp_path / "stack_info.csv").read_bytes() == text.encode("utf-8")
    assert sorted(os.listdir(tmp_path)) == ["stack_info.csv"]  # no temporary file left beside it


def test_a_side_file_written_again_replaces_the_previous_one_whole(tmp_path):
    write_artifact(str(tmp_path), "replica_check.json", '{\n "checks": 1,\n "mismatches": [' + "0, " * 1000 + "0]\n}")
    write_artifact(str(tmp_path), "replica_check.json", '{\n "checks": 2\n}')
    assert (tmp_path / "replica_check.json").read_text(encoding="utf-8") == '{\n "checks": 2\n}'
    assert sorted(os.listdir(tmp_path)) == ["replica_check.json"]


def test_a_write_that_fails_midway_keeps_the_previous_file_and_removes_its_temporary_file(tmp_path):
    write_artifact(str(tmp_path), "replica_check.json", '{"checks": 1}')
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate cannot be encoded: fails inside the write
        write_artifact(str(tmp_path), "replica_check.json", '{"checks": 2, "name": "\ud800"}')
    assert (tmp_path / "replica_check.json").read_text(encoding="utf-8") == '{"checks": 1}'
    assert sorted(os.listdir(tmp_path)) == ["replica_check.json"]


def test_a_missing_directory_is_an_oserror_unless_the_caller_asks_for_it_to_be_made(tmp_path):
    target = tmp_path / "module_struct" / "rank3"
    with pytest.raises(OSError):
        write_artifact(str(target), "module_struct.json", "{}")
    assert not target.exists()
    path = write_artifact(str(target), "module_struct.json", "{}", make_directory=True)
    assert path == os.path.join(str(target), "module_struct.json")
    assert (target / "module_struct.json").read_text() == "{}"
