"""A config edited while training runs into something invalid (bad bytes, NaN, a syntax error,
an unknown key, a file the editor has not finished writing, a document no parser can take)
leaves the config in force alone; the next valid edit takes effect."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import msmon.runtime.reload
from conftest import MLP, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.output.sinks import format_names

GOOD = {"wg_distribution": True, "format": "csv", "ops": ["norm"]}
LATER = {**GOOD, "ops": ["norm", "max"]}

BAD_VERSIONS = {
    "not-utf8": (
        "monitor.json",
        '{"wg_distribution": true, "format": "csv", "ops": ["norm"]}  # \u76d1\u63a7'.encode("gbk"),
    ),
    "nan": ("monitor.json", b'{"wg_distribution": true, "format": "csv", "ops": ["norm"], "eps": NaN}'),
    "syntax-error": ("monitor.json", b'{"wg_distribution": true, "format": "csv" "ops": ["norm"]}'),
    "unknown-format": ("monitor.json", b'{"wg_distribution": true, "format": ["csv", "hdf5"], "ops": ["norm"]}'),
    "unknown-key": ("monitor.json", b'{"wg_distribution": true, "format": "csv", "opps": ["norm"]}'),
    "truncated": ("monitor.json", b'{"wg_distribution": true, "format": "csv", "ops": ["no'),
    "empty-json": ("monitor.json", b""),
    "empty-yaml": ("monitor.yaml", b""),
    "yaml-comments-only": ("monitor.yaml", b"# being rewritten\n"),
    "yaml-number-key": ("monitor.yaml", b"wg_distribution: true\nformat: csv\n1: norm\n"),
    "yaml-null-key": ("monitor.yaml", b"wg_distribution: true\nformat: csv\nnull: norm\n"),
    "huge-integer": ("monitor.json", b'{"wg_distribution": true, "ndigits": ' + b"9" * 5000 + b"}"),
    "nested-too-deep": ("monitor.json", b"[" * 100_000),
    "unknown-target": ("monitor.json", b'{"wg_distribution": true, "format": "csv", "targets": {"fc9": {}}}'),
}


def write_version(path, data: bytes, stamp: int) -> None:
    path.write_bytes(data)
    os.utime(path, ns=(stamp, stamp))


def train_steps(model, optimizer, n):
    for _ in range(n):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def errors(caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.ERROR, logger="msmon")
    return lambda: [r.getMessage() for r in caplog.records if "edited config is invalid" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(BAD_VERSIONS))
def test_an_invalid_edit_keeps_the_old_config_and_a_later_valid_edit_takes_effect(
    name, tmp_path, output_dir, errors, monkeypatch
):
    file_name, bad = BAD_VERSIONS[name]
    path = tmp_path / file_name
    write_version(path, json.dumps(GOOD).encode(), 1_000_000_000)
    parses = []
    real_load = msmon.runtime.reload.load_config
    monkeypatch.setattr(msmon.runtime.reload, "load_config", lambda *a, **k: parses.append(a) or real_load(*a, **k))
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    parses.clear()
    train_steps(model, optimizer, 2)  # steps 0, 1
    write_version(path, bad, 2_000_000_000)
    train_steps(model, optimizer, 2)  # step 2 reads the bad version; 3 keeps on
    assert mon.attached and mon.runner.unhook is not None  # monitoring did not stop
    write_version(path, json.dumps(LATER).encode(), 3_000_000_000)
    train_steps(model, optimizer, 3)  # step 4 reads the good one: 5, 6 follow it
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_reduced")
    assert {int(r["step"]) for r in rows} == set(range(7))
    assert {int(r["step"]) for r in rows if "max" in r} == {5, 6}
    logged = errors()
    assert len(logged) == 1 and "\n" not in logged[0] and "rank 0" in logged[0], logged
    assert len(parses) == 2  # the bad version once, the good one once: not every step


def test_an_edit_naming_an_unknown_format_is_refused_with_the_message_trainermon_gives(tmp_path, output_dir, errors):
    path = tmp_path / "monitor.json"
    write_version(path, json.dumps(GOOD).encode(), 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 1)  # step 0
    write_version(path, json.dumps({**GOOD, "format": ["csv", "hdf5"]}).encode(), 2_000_000_000)
    train_steps(model, optimizer, 2)  # step 1 reads the edit and keeps csv; 2 keeps on
    mon.close()
    assert {int(r["step"]) for r in read_csv_rows(rank_dir(output_dir), "grad_reduced")} == {0, 1, 2}
    (logged,) = errors()
    assert logged.endswith(f"{path}: format: unknown format 'hdf5'; expected {format_names()}")


def test_two_versions_in_one_mtime_tick_the_second_is_read(tmp_path, output_dir, errors):
    """An editor truncates the file, then writes it, within one tick of a coarse mtime clock."""
    path = tmp_path / "monitor.json"
    write_version(path, json.dumps(GOOD).encode(), 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 1)  # step 0
    write_version(path, b"", 2_000_000_000)
    train_steps(model, optimizer, 1)  # step 1 reads the empty file
    write_version(path, json.dumps(LATER).encode(), 2_000_000_000)
    train_steps(model, optimizer, 3)  # step 2 reads it whole: 3, 4 follow it
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_reduced")
    assert {int(r["step"]) for r in rows if "max" in r} == {3, 4}
    assert len(errors()) == 1 and "empty" in errors()[0]


def test_deeply_nested_or_huge_numbers_are_config_errors_before_training(tmp_path):
    from msmon.config import ConfigError, load_config

    for name in ("yaml-number-key", "huge-integer", "nested-too-deep"):
        file_name, data = BAD_VERSIONS[name]
        path = tmp_path / file_name
        path.write_bytes(data)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)
