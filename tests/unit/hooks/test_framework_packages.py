"""The per-framework packages of hooks/: what each declares, the order they are asked in, and the
supported-version check when one switches on."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import torch

from conftest import MLP
from msmon import hooks, optimizers
from msmon.config import ConfigError
from msmon.hooks import versions


def test_every_registered_package_declares_the_instrumentor_interface():
    for package in hooks.frameworks():
        assert callable(package.instrument) and callable(package.uninstrument), package.__name__
        assert isinstance(package.DISTRIBUTION, str) and isinstance(package.SUPPORTED, str), package.__name__
        versions.in_range("1.0", package.SUPPORTED)  # parses


def test_the_installed_frameworks_are_inside_what_their_packages_support():
    for package in hooks.frameworks():
        version = versions.installed(package.DISTRIBUTION)
        if version is not None:
            assert versions.in_range(version, package.SUPPORTED), (package.__name__, version)


def test_importing_the_packages_imports_no_framework():
    code = (
        "import sys; from msmon import hooks; hooks.frameworks(); import msmon.optimizers; "
        "print(sorted(m for m in ('deepspeed', 'megatron.core', 'msmon.api') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_opt_ty_is_the_union_of_the_packages_and_megatron_is_asked_first():
    declared = [name for package in hooks.frameworks() for name in getattr(package, "OPT_TY", {})]
    assert list(optimizers.OPT_TY) == declared
    assert declared[0].startswith("Megatron_") and declared[-1].startswith("DeepSpeed")
    with pytest.raises(ConfigError, match="is not an optimizer type msprobe knows"):
        optimizers.check_opt_ty("NoSuchOptimizer")


def test_a_plain_torch_optimizer_falls_through_to_torch_optim():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # held here: adapters hold it weakly
    adapter = optimizers.adapter_for(optimizer)
    assert type(adapter).__name__ == "TorchOptimAdapter" and adapter.family == "torch"
    assert [p for p in adapter.params()] == list(model.parameters())


def test_framework_optimizer_classes_come_from_the_packages():
    from msmon.optimizers.base import framework_optimizer_classes

    names = framework_optimizer_classes()
    assert {"DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer", "ChainedOptimizer", "MegatronOptimizer"} <= names


@pytest.mark.parametrize(
    ("version", "supported", "inside"),
    [
        ("0.19.8", ">=0.17,<0.20", True),
        ("0.20.0", ">=0.17,<0.20", False),
        ("0.16.9", ">=0.17,<0.20", False),
        ("2.13.0+cpu", ">=2.1,<2.14", True),
        ("2.14", ">=2.1,<2.14", False),
        ("0.16.1rc0", ">=0.16,<0.17", True),
        ("1.0", "", True),
    ],
)
def test_version_ranges(version, supported, inside):
    assert versions.in_range(version, supported) is inside


def test_a_version_outside_supported_warns_once_and_still_switches_on(write_config, monkeypatch, caplog):
    hooks.frameworks()  # cached before the registry gets its fake line
    package = types.ModuleType("msmon.hooks.fake_framework")
    switched_on = []
    package.DISTRIBUTION = "msmon-fake-framework"  # not installed: the version is its module's __version__
    package.SUPPORTED = ">=1.0,<2.0"
    package.instrument = switched_on.append
    package.uninstrument = lambda: None
    library = types.ModuleType("fake_framework")
    library.__version__ = "2.5.0"
    monkeypatch.setitem(sys.modules, "msmon.hooks.fake_framework", package)
    monkeypatch.setitem(sys.modules, "fake_framework", library)
    monkeypatch.setitem(hooks.INSTRUMENTORS, "fake_framework", "fake_framework")
    monkeypatch.setattr(hooks, "_enabled", {})
    monkeypatch.setattr(versions, "_warned", set())
    session = hooks.Session.from_file(write_config({}))
    with caplog.at_level(logging.WARNING, logger="msmon"):
        assert hooks.instrument("fake_framework", session)
        hooks._enabled.clear()
        assert hooks.instrument("fake_framework", session)
    warnings = [r.getMessage() for r in caplog.records if "outside the versions msmon supports" in r.getMessage()]
    assert len(warnings) == 1 and "msmon-fake-framework 2.5.0" in warnings[0] and ">=1.0,<2.0" in warnings[0]
    assert switched_on == [session, session]


def test_wrap_method_undo_removes_only_its_own_wrapper():
    from msmon.hooks.patching import wrap_method

    class Engine:
        def reduce(self, x):
            return x + 1

    engine, seen = Engine(), []
    undo = wrap_method(engine, "reduce", before=seen.append, after=lambda result, x: seen.append(result))
    assert engine.reduce(1) == 2 and seen == [1, 2]
    undo()
    assert "reduce" not in engine.__dict__ and engine.reduce(1) == 2 and seen == [1, 2]


def test_each_framework_entry_point_is_replaced_once_and_restored():
    """deepspeed.initialize, Accelerator.prepare and Megatron's builders: a second instrument
    (a post-import hook firing twice) must not wrap the wrapper."""
    from msmon.hooks.patching import Replacements

    library = types.SimpleNamespace(build=lambda x: x + 1)
    original = library.build
    replaced = Replacements()
    assert replaced.replace(library, "build", lambda f: lambda x: f(x) * 10)
    assert not replaced.replace(library, "build", lambda f: lambda x: f(x) * 100)
    assert not replaced.replace(library, "absent", lambda f: f)
    assert library.build(1) == 20
    replaced.restore()
    assert library.build is original
    assert replaced.replace(library, "build", lambda f: lambda x: -f(x)) and library.build(1) == -2


@pytest.mark.parametrize(
    "instrumentor, library, owner, name",
    [
        ("msmon.hooks.deepspeed.instrumentor", "deepspeed", "deepspeed", "initialize"),
        ("msmon.hooks.fsdp.accelerate_prepare", "accelerate", "Accelerator", "prepare"),
    ],
)
def test_instrument_twice_then_uninstrument_gives_back_the_librarys_own_function(instrumentor, library, owner, name):
    import importlib

    from msmon.config import MonitorConfig

    lib = pytest.importorskip(library)
    target = lib if owner == library else getattr(lib, owner)
    module = importlib.import_module(instrumentor)
    before = getattr(target, name)
    session = hooks.Session(config_path="monitor.json", config=MonitorConfig())
    module.instrument(session)
    wrapped = getattr(target, name)
    module.instrument(session)
    assert wrapped is not before and getattr(target, name) is wrapped
    module.uninstrument()
    assert getattr(target, name) is before
