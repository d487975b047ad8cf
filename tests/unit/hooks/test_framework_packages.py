"""The per-framework packages of hooks/: the typed spec each exports, the order they are asked
in, and the supported-version check when one switches on."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon, hooks
from msmon.config import ConfigError
from msmon.hooks.core import adapter_choice, registry, versions
from msmon.hooks.core.adapters import OptimizerAdapter
from msmon.hooks.core.spec import Framework


def test_every_registered_package_exports_a_framework_spec_named_as_its_folder():
    specs = registry.frameworks()
    assert [spec.name for spec in specs] == list(registry.SWITCHED_ON_BY)
    for spec in specs:
        assert isinstance(spec, Framework), spec
        assert callable(spec.instrument) and callable(spec.uninstrument), spec.name
        assert isinstance(spec.distribution, str) and isinstance(spec.supported, str), spec.name
        versions.in_range("1.0", spec.supported)  # parses


def test_torch_optim_whose_adapter_fits_any_optimizer_is_asked_after_every_framework_with_adapters():
    with_adapters = [spec.name for spec in registry.frameworks() if spec.adapter_for is not None]
    assert with_adapters[-1] == "torch_optim" and with_adapters[:2] == ["megatron", "deepspeed"]


def test_the_installed_frameworks_are_inside_what_their_packages_support():
    for spec in registry.frameworks():
        version = versions.installed(spec.distribution)
        if version is not None:
            assert versions.in_range(version, spec.supported), (spec.name, version)


def test_importing_the_packages_imports_no_framework():
    code = (
        "import sys; from msmon.hooks.core import registry; registry.frameworks(); "
        "import msmon.hooks.core.adapter_choice; "
        "print(sorted(m for m in ('deepspeed', 'megatron.core', 'msmon.api') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_opt_ty_is_the_union_of_the_packages_and_megatron_is_asked_first():
    declared = [name for spec in registry.frameworks() for name in spec.opt_ty]
    optimizers = adapter_choice
    assert list(optimizers.OPT_TY) == declared
    assert declared[0].startswith("Megatron_") and declared[-1].startswith("DeepSpeed")
    with pytest.raises(ConfigError, match="is not an optimizer type msprobe knows"):
        optimizers.check_opt_ty("NoSuchOptimizer")


def test_a_plain_torch_optimizer_falls_through_to_torch_optim():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # held here: adapters hold it weakly
    adapter = adapter_choice.adapter_for(optimizer)
    assert type(adapter).__name__ == "TorchOptimAdapter" and adapter.family == "torch"
    assert [p for p in adapter.params()] == list(model.parameters())


def test_framework_optimizer_classes_come_from_the_packages():
    names = adapter_choice.framework_optimizer_classes()
    assert {"DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer", "ChainedOptimizer", "MegatronOptimizer"} <= names


class _FakeOptimizer(torch.optim.SGD):
    """An optimizer class only the fake framework below knows."""


class _FakeAdapter(OptimizerAdapter):
    family = "fake"


def _fake_package(monkeypatch, spec: Framework) -> None:
    package = types.ModuleType("msmon.hooks.fake_framework")
    package.FRAMEWORK = spec
    monkeypatch.setitem(sys.modules, "msmon.hooks.fake_framework", package)


def test_a_new_framework_is_one_package_exporting_a_spec_and_one_registry_line(monkeypatch):
    """The adapter choice and the pipeline position read the new spec; nothing else is told."""
    _fake_package(
        monkeypatch,
        Framework(
            name="fake_framework",
            distribution="msmon-fake-framework",
            supported="",
            instrument=lambda session: None,
            uninstrument=lambda: None,
            adapter_for=lambda opt: _FakeAdapter(opt) if isinstance(opt, _FakeOptimizer) else None,
        ),
    )
    monkeypatch.setattr(registry, "SWITCHED_ON_BY", {"fake_framework": "fake_framework", **registry.SWITCHED_ON_BY})
    registry.frameworks.cache_clear()
    try:
        model = MLP()
        mine, plain = _FakeOptimizer(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        assert type(adapter_choice.adapter_for(mine)) is _FakeAdapter
        assert type(adapter_choice.adapter_for(plain)).__name__ == "TorchOptimAdapter"
    finally:
        registry.frameworks.cache_clear()


def test_a_package_exporting_no_framework_spec_is_reported_and_the_others_switch_on(write_config, monkeypatch, caplog):
    package = types.ModuleType("msmon.hooks.fake_framework")
    package.FRAMEWORK = {"name": "fake_framework"}  # the untyped shape of old
    monkeypatch.setitem(sys.modules, "msmon.hooks.fake_framework", package)
    monkeypatch.setitem(registry.SWITCHED_ON_BY, "fake_framework", "fake_framework")
    monkeypatch.setattr(hooks, "_enabled", {})
    session = hooks.Session.from_file(write_config({}), TrainerMon)
    with caplog.at_level(logging.ERROR, logger="msmon"):
        assert not hooks.instrument("fake_framework", session)
    assert any(
        "fake_framework cannot be imported" in r.getMessage() and "not a Framework" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(TypeError, match="not a Framework"):
        registry.load("fake_framework")


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
    registry.frameworks()  # cached before the registry gets its fake line
    switched_on = []
    _fake_package(
        monkeypatch,
        Framework(
            name="fake_framework",
            distribution="msmon-fake-framework",  # not installed: the version is its module's __version__
            supported=">=1.0,<2.0",
            instrument=switched_on.append,
            uninstrument=lambda: None,
        ),
    )
    library = types.ModuleType("fake_framework")
    library.__version__ = "2.5.0"
    monkeypatch.setitem(sys.modules, "fake_framework", library)
    monkeypatch.setitem(registry.SWITCHED_ON_BY, "fake_framework", "fake_framework")
    monkeypatch.setattr(hooks, "_enabled", {})
    monkeypatch.setattr(versions, "_warned", set())
    session = hooks.Session.from_file(write_config({}), TrainerMon)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        assert hooks.instrument("fake_framework", session)
        hooks._enabled.clear()
        assert hooks.instrument("fake_framework", session)
    warnings = [r.getMessage() for r in caplog.records if "outside the versions msmon supports" in r.getMessage()]
    assert len(warnings) == 1 and "msmon-fake-framework 2.5.0" in warnings[0] and ">=1.0,<2.0" in warnings[0]
    assert switched_on == [session, session]


def test_wrap_method_undo_removes_only_its_own_wrapper():
    from msmon.hooks.core.patching import wrap_method

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
    from msmon.hooks.core.patching import Replacements

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
    session = hooks.Session(config_path="monitor.json", config=MonitorConfig(), build_monitor=TrainerMon)
    module.instrument(session)
    wrapped = getattr(target, name)
    module.instrument(session)
    assert wrapped is not before and getattr(target, name) is wrapped
    module.uninstrument()
    assert getattr(target, name) is before
