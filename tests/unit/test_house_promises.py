"""The house's four promises, kept under the tests: a new statistic is one entry in stats/ops.py,
a new output format one sink file, a new CLI verb one command file, a new framework one folder
of hooks/, and nothing else changes. A copy of msmon's source, tests and lint settings gets the
four (tests/house_additions.py: `absmean`, `jsonl`, `msmon tail`, `hooks/colossal/`); the test
files that enumerate the registries run against it in a subprocess, as do the import contract
and its two checks (`make lint`'s), mypy on the new framework under the project's settings (no
override of its own), and one monitored run that writes the new op through the new sink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from house_additions import NEW_FORMAT, NEW_FRAMEWORK, NEW_OP, NEW_VERB, write_additions

BIN = Path(sys.executable).parent

# the registry-driven tests, the quick ones of each registry (the whole files pass too: slower)
REGISTRY_TESTS = [
    "tests/unit/sinks/test_sink_registry.py",
    "tests/unit/launcher/test_verb_files.py",
    "tests/unit/hooks/test_framework_packages.py",
    "tests/unit/test_stats.py::test_the_op_table_names_a_field_and_a_combine_rule_or_the_ops_it_is_derived_from_for_every_op",
    "tests/unit/test_reload_invalid_edits.py::test_an_edit_naming_an_unknown_format_is_refused_with_the_message_trainermon_gives",
]
SLOW = "not exporting_no_framework and not switched_on_when and not instrument_twice and not importing_the_packages"


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    return write_additions(tmp_path_factory.mktemp("house"))


def in_copy(copy: Path, *command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "MONITOR_"))}
    env.update(PYTHONPATH=f"{copy / 'src'}{os.pathsep}{copy / 'tests'}", MSMON_NATIVE_STATS="0")
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_registry_driven_tests_pass_with_a_new_op_sink_verb_and_framework_added(copy):
    run = in_copy(copy, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SLOW, *REGISTRY_TESTS)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_the_import_contract_holds_and_mypy_needs_no_override_for_the_additions(copy):
    contract = in_copy(copy, str(BIN / "lint-imports"), "--no-cache")
    assert contract.returncode == 0 and "0 broken" in contract.stdout, contract.stdout[-3000:]
    cycles = in_copy(copy, sys.executable, "tools/import_cycles.py")
    assert cycles.returncode == 0, cycles.stdout
    frameworks = in_copy(copy, sys.executable, "tools/framework_packages.py")
    assert frameworks.returncode == 0 and "imports another" in frameworks.stdout, frameworks.stdout
    package = copy / "src" / "msmon"
    new_files = [package / "hooks" / NEW_FRAMEWORK, package / "output" / "sinks" / f"{NEW_FORMAT}_sink.py"]
    new_files.append(package / "launcher" / f"{NEW_VERB}_command.py")
    typed = in_copy(copy, str(BIN / "mypy"), "--no-incremental", "--follow-imports=skip", *map(str, new_files))
    assert typed.returncode == 0, typed.stdout


def test_each_addition_works_end_to_end_in_the_copy(copy, tmp_path):
    """The verb runs; a monitor writes the new op through the new sink; the new framework is
    asked in its precedence's place; the config and the op table know the new op."""
    verb = in_copy(copy, sys.executable, "-m", "msmon.launcher", NEW_VERB, str(tmp_path))
    assert verb.returncode == 0 and verb.stdout.strip() == str(tmp_path), verb.stderr
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": [NEW_FORMAT], "ops": ["norm", NEW_OP]}))
    script = f"""
import glob, json, os, torch
from msmon import TrainerMon
from msmon.seams import registry
os.environ["MONITOR_OUTPUT_DIR"] = {str(tmp_path / "out")!r}
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = TrainerMon({str(config)!r})
monitor.set_monitor(model, optimizer)
model(torch.randn(5, 4)).square().mean().backward()
want = float(model.weight.grad.double().abs().mean())
optimizer.step()
monitor.close()
(path,) = glob.glob({str(tmp_path / "out" / "**" / "steps.jsonl")!r}, recursive=True)
rows = [json.loads(line) for line in open(path)]
(got,) = [r["{NEW_OP}"] for r in rows if r["tag"] == "0:weight/rank0/grad_reduced"]
print(abs(got - want) <= 1e-6 * want, [s.name for s in registry.frameworks()])
"""
    run = in_copy(copy, sys.executable, "-c", script)
    assert run.returncode == 0, run.stderr[-3000:]
    close, names = run.stdout.strip().split(" ", 1)
    assert close == "True"
    assert names == str(["megatron", "deepspeed", "fsdp", NEW_FRAMEWORK, "torch_optim", "torch_distributed"])
