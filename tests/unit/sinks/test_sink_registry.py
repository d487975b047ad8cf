"""The sinks come from a registry: each sink file, `<format>_sink.py`, registers its Sink class
under its format name, the format names are the sink files' names (known without importing them),
and the rank output builds the sinks of the config's `format` from it, by name, in its order."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.config import ConfigError, parse_config
from msmon.output import sinks
from msmon.output.sinks.api_sink import ApiSink
from msmon.output.sinks.base import Sink
from msmon.output.sinks.csv_sink import CsvSink
from msmon.output.sinks.mlflow_sink import MlflowSink
from msmon.output.sinks.parquet_sink import ParquetSink
from msmon.output.sinks.tensorboard_sink import TensorBoardSink
from msmon.output.sinks.wandb_sink import WandbSink

# every format, as the registry knows them: the sink files' names (a new one adds itself)
FORMATS = sorted(p.name[: -len("_sink.py")] for p in Path(sinks.__file__).parent.glob("*_sink.py"))


def test_the_format_names_are_the_sink_files_names_read_without_importing_them_or_torch():
    code = (
        "import sys; from msmon.output import sinks; "
        "print(sinks.format_names(), sorted(m for m in sys.modules if m.endswith('_sink')), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{FORMATS} [] False"
    assert sorted(sinks.registered_formats()) == sinks.format_names()


def test_each_sink_class_is_registered_under_the_name_its_log_lines_use():
    registered = sinks.registered_formats()
    assert sorted(registered) == FORMATS and all(cls.name == name for name, cls in registered.items())
    assert {name: registered[name] for name in ("csv", "tensorboard", "api", "wandb", "mlflow", "parquet")} == {
        "csv": CsvSink,
        "tensorboard": TensorBoardSink,
        "api": ApiSink,
        "wandb": WandbSink,
        "mlflow": MlflowSink,
        "parquet": ParquetSink,
    }
    assert (CsvSink.name, TensorBoardSink.name, ApiSink.name, ParquetSink.name) == (
        "csv",
        "tensorboard",
        "api",
        "parquet",
    )


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

    Other.__module__ = "msmon.output.sinks.csv_sink"  # even from the right file
    with pytest.raises(ValueError, match="output format 'csv' is registered twice"):
        sinks.sink_format("csv")(Other)
    assert sinks.registered_formats()["csv"] is CsvSink


def test_a_sink_registered_under_a_name_other_than_its_file_is_refused():
    class Misnamed(Sink):
        pass

    Misnamed.__module__ = "msmon.output.sinks.csv_sink"
    with pytest.raises(ValueError, match=r"format 'lines' must be written by a sink file named lines_sink.py, not csv"):
        sinks.sink_format("lines")(Misnamed)
    assert "lines" not in sinks.registered_formats()


def test_importing_the_sink_registry_loads_no_sink_file_and_no_torch():
    code = (
        "import sys, msmon.output.sinks; "
        "print(sorted(m for m in sys.modules if m.endswith('_sink')), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


LINES_SINK = textwrap.dedent(
    """
    import json
    import os

    from msmon.output.sinks import sink_format
    from msmon.output.sinks.base import Sink


    @sink_format("lines")
    class LinesSink(Sink):
        writes_files = True

        def __init__(self, log_dir):
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "rows.jsonl"), "a")

        @classmethod
        def for_rank(cls, log_dir, config):
            return cls(log_dir)

        def write(self, record):
            for key, row in zip(record.keys, record.values):
                line = {"step": record.step, "category": key.category, "name": key.name}
                self.file.write(json.dumps({**line, **dict(zip(record.ops, map(float, row)))}) + "\\n")

        def flush(self):
            self.file.flush()

        def close(self):
            self.file.close()
    """
)


@pytest.fixture
def new_sink_file(tmp_path, monkeypatch):
    """Write a sink file for a new format, "lines", as a contributor would add one to
    msmon/output/sinks/: here in a folder of the test's own, added to the package's path."""

    def write(source: str) -> None:
        folder = tmp_path / "more_sinks"
        folder.mkdir()
        (folder / "lines_sink.py").write_text(source)
        monkeypatch.setattr(sinks, "__path__", [*sinks.__path__, str(folder)])

    yield write
    sinks._REGISTRY.pop("lines", None)
    sys.modules.pop("msmon.output.sinks.lines_sink", None)
    if hasattr(sinks, "lines_sink"):
        delattr(sinks, "lines_sink")


def test_a_new_sink_file_is_a_format_the_config_accepts_and_gets_every_recorded_step(
    write_config, output_dir, new_sink_file
):
    new_sink_file(LINES_SINK)
    assert sinks.format_names() == sorted([*FORMATS, "lines"])
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config({"wg_distribution": True, "format": ["lines", "csv"], "ops": ["norm"]}))
    monitor.set_monitor(model, optimizer)
    norms = []
    for _ in range(3):
        model(torch.randn(5, 8)).square().mean().backward()
        norms.append(float(model.fc1.weight.grad.double().norm()))
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    (rows_file,) = glob.glob(str(output_dir / "**" / "rows.jsonl"), recursive=True)
    with open(rows_file) as f:
        rows = [json.loads(line) for line in f]
    fc1 = [r for r in rows if (r["category"], r["name"]) == ("grad_reduced", "fc1.weight")]
    assert [r["step"] for r in fc1] == [0, 1, 2]
    assert [r["norm"] for r in fc1] == pytest.approx(norms, rel=1e-6)


def test_a_sink_file_that_registers_no_sink_is_refused_when_the_sinks_are_built(new_sink_file):
    new_sink_file(LINES_SINK.replace('@sink_format("lines")', ""))
    with pytest.raises(ValueError, match=r"output/sinks/lines_sink.py declares no Sink with @sink_format\('lines'\)"):
        sinks.registered_formats()


def test_the_config_takes_any_format_name_and_the_sink_registry_refuses_an_unknown_one_with_the_closest():
    config = parse_config({"format": ["csv", "tensorbord"]})
    assert config.format == ["csv", "tensorbord"]  # the config checks the shape; the names are the output's
    with pytest.raises(ConfigError) as err:
        sinks.check_formats(config, "/jobs/monitor.json")
    assert str(err.value) == (
        f"/jobs/monitor.json: format: unknown format 'tensorbord'; expected {FORMATS} (did you mean 'tensorboard'?)"
    )
    sinks.check_formats(parse_config({"format": ["api", "csv", "tensorboard"]}))


def test_trainermon_refuses_an_unknown_format_before_training_with_the_file_and_the_known_ones(write_config):
    path = write_config({"wg_distribution": True, "format": ["csv", "hdf5"]})
    with pytest.raises(ConfigError) as err:
        TrainerMon(path)
    assert str(err.value) == f"{path}: format: unknown format 'hdf5'; expected {FORMATS}"


def test_a_format_whose_client_package_is_missing_is_refused_before_training_naming_the_extra(
    write_config, new_sink_file
):
    """A sink file names the package it needs (`REQUIRES`); the check reads it from the file's text,
    without importing the file, so a missing tracker client never surfaces in the middle of a run."""
    new_sink_file('REQUIRES = {"msmon_no_such_client": "msmon[lines]"}\n' + LINES_SINK)
    path = write_config({"format": ["csv", "lines"]})
    with pytest.raises(ConfigError) as err:
        TrainerMon(path)
    assert str(err.value) == (
        f"{path}: format: 'lines' needs msmon_no_such_client, which is not installed: pip install 'msmon[lines]'"
    )
    assert "msmon.output.sinks.lines_sink" not in sys.modules
    assert sinks.required_modules("wandb") == {"wandb": "msmon[wandb]"} and sinks.required_modules("csv") == {}
    sinks.check_formats(parse_config({"format": ["csv", "wandb", "mlflow"]}))  # installed here: accepted
