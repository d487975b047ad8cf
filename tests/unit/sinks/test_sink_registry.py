"""The sinks come from a registry: each sink file registers its Sink class under its format name,
and the rank output builds the sinks of the config's `format` from it, by name, in its order."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.config import FORMATS, parse_config
from msmon.config import parsing as config_parsing
from msmon.output import sinks
from msmon.output.records import StepRecord
from msmon.output.sinks.api_sink import ApiSink
from msmon.output.sinks.base import Sink
from msmon.output.sinks.csv_sink import CsvSink
from msmon.output.sinks.tensorboard_sink import TensorBoardSink


def test_every_format_the_config_accepts_is_a_registered_sink_file_and_no_other():
    assert set(sinks.registered_formats()) == set(FORMATS)


def test_each_sink_class_is_registered_under_the_name_its_log_lines_use():
    assert sinks.registered_formats() == {"csv": CsvSink, "tensorboard": TensorBoardSink, "api": ApiSink}
    assert (CsvSink.name, TensorBoardSink.name, ApiSink.name) == ("csv", "tensorboard", "api")


def test_the_sinks_are_built_in_the_order_the_format_names_them(tmp_path):
    config = parse_config({"format": ["api", "csv", "tensorboard"], "ndigits": 3, "step_count_per_record": 5})
    built = sinks.build_sinks(config.format, str(tmp_path), config)
    try:
        assert [type(s) for s in built] == [ApiSink, CsvSink, TensorBoardSink]
        csv = built[1]
        assert isinstance(csv, CsvSink) and (csv.log_dir, csv.ndigits, csv.window) == (str(tmp_path), 3, 5)
    finally:
        for sink in built:
            sink.close()


def test_a_format_registered_twice_under_one_name_is_refused():
    class Other(Sink):
        pass

    with pytest.raises(ValueError, match="output format 'csv' is registered twice"):
        sinks.sink_format("csv")(Other)
    assert sinks.registered_formats()["csv"] is CsvSink


def test_importing_the_sink_registry_loads_no_sink_file_and_no_torch():
    code = (
        "import sys, msmon.output.sinks; "
        "print(sorted(m for m in sys.modules if m.endswith('_sink')), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


class _Lines(Sink):
    """A format of the test's own: one line per row, kept in memory."""

    seen: list[tuple[int, str, str, list[float]]] = []

    def write(self, record: StepRecord) -> None:
        self.seen.extend((record.step, k.category, k.name, list(row)) for k, row in zip(record.keys, record.values))


@pytest.fixture
def lines_format(monkeypatch):
    """Register `_Lines` as format "lines", as a new sink file would, and let the config accept it."""
    monkeypatch.setattr(config_parsing, "FORMATS", (*FORMATS, "lines"))
    sinks.sink_format("lines")(_Lines)
    _Lines.seen = []
    yield _Lines
    del sinks._REGISTRY["lines"]


def test_a_sink_registered_under_a_new_format_name_gets_every_recorded_step(write_config, output_dir, lines_format):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config({"wg_distribution": True, "format": "lines", "ops": ["norm"]}))
    monitor.set_monitor(model, optimizer)
    norms = []
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        norms.append(float(model.fc1.weight.grad.double().norm()))
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    fc1 = [
        (step, row)
        for step, category, name, row in lines_format.seen
        if (category, name) == ("grad_reduced", "fc1.weight")
    ]
    assert [step for step, _ in fc1] == [0, 1]
    assert [row[0] for _, row in fc1] == pytest.approx(norms, rel=1e-6)
