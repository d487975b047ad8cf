"""The per-framework packages of hooks/: the typed spec each exports, the order they are asked
in, and the supported-version check when one switches on."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon, hooks
from msmon.config import ConfigError
from msmon.seams import adapter_choice, registry, versions
from msmon.seams.spec import Framework


def test_every_package_in_the_hooks_folder_exports_a_framework_spec_named_as_its_folder():
    folders = sorted(p.name for p in Path(hooks.__file__).parent.iterdir() if (p / "__init__.py").is_file())
    specs = registry.frameworks()
    assert sorted(spec.name for spec in specs) == folders
    for spec in specs:
        assert isinstance(spec, Framework), spec
        assert callable(spec.instrument) and callable(spec.uninstrument), spec.name
        assert isinstance(spec.distribution, str) and isinstance(spec.supported, str), spec.name
        assert isinstance(spec.switched_on_by, str) and isinstance(spec.precedence, int), spec.name
        versions.in_range("1.0", spec.supported)  # parses


def test_the_frameworks_are_asked_by_precedence_most_specific_first_and_each_switched_on_by_its_library():
    """msmon's own frameworks in their order, a new one (a folder of hooks/) wherever its
    precedence puts it."""
    own = [
        ("megatron", "megatron.core"),
        ("deepspeed", "deepspeed"),
        ("fsdp", "torch.distributed.fsdp"),
        ("torch_optim", "torch"),
        ("torch_distributed", "torch"),
    ]
    asked = [(spec.name, spec.switched_on_by) for spec in registry.frameworks()]
    assert [entry for entry in asked if entry in own] == own
    assert len(asked) == len(registry.package_names())
    assert [spec.precedence for spec in registry.frameworks()] == sorted(s.precedence for s in registry.frameworks())


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
        "import sys; from msmon.seams import registry; registry.frameworks(); "
        "import msmon.seams.adapter_choice; "
        "print(sorted(m for m in ('deepspeed', 'megatron.core', 'msmon.api') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_loading_the_registry_and_every_framework_spec_imports_no_torch():
    """The framework packages' `__init__.py` files are light, their parent's too: the registry
    answers in a process that never imported torch (the launcher, the bootstrap before torch)."""
    code = (
        "import sys; from msmon.seams import registry; names = [s.name for s in registry.frameworks()]; "
        "print(len(names) == len(registry.package_names()), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True False"


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


def _fake_package(monkeypatch, spec: Framework) -> None:
    """A package msmon.hooks.fake_framework held in sys.modules only (not in the hooks folder)."""
    package = types.ModuleType("msmon.hooks.fake_framework")
    package.FRAMEWORK = spec
    monkeypatch.setitem(sys.modules, "msmon.hooks.fake_framework", package)


@pytest.fixture
def hooks_folder(tmp_path, monkeypatch):
    """A second folder on msmon.hooks.__path__: a package written there is a package of hooks/, as if
    written in src/msmon/hooks/. Its packages are forgotten again after the test."""
    folder = tmp_path / "hooks"
    folder.mkdir()
    monkeypatch.setattr(hooks, "__path__", [*hooks.__path__, str(folder)])
    registry.frameworks.cache_clear()
    yield folder
    registry.frameworks.cache_clear()
    for package in folder.iterdir():
        name = f"msmon.hooks.{package.name}"
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        if hasattr(hooks, package.name):
            delattr(hooks, package.name)


def _write_package(folder: Path, name: str, init: str) -> None:
    (folder / name).mkdir()
    (folder / name / "__init__.py").write_text(textwrap.dedent(init))


# a whole new framework: its folder's __init__.py, and nothing else anywhere
NEW_FRAMEWORK = """
    \"""A library msmon did not know: it fits any optimizer, and says when it is switched on.\"""

    from msmon.seams.adapters import OptimizerAdapter
    from msmon.seams.spec import Framework


    class NewAdapter(OptimizerAdapter):
        family = "{name}"


    def instrument(session):
        session.emit("{name} switched on")


    FRAMEWORK = Framework(
        name="{name}",
        switched_on_by="{trigger}",
        precedence={precedence},
        distribution="{name}",
        supported="",
        instrument=instrument,
        uninstrument=lambda: None,
        adapter_for=NewAdapter,
    )
"""


@pytest.mark.parametrize(("precedence", "asked_before"), [(25, "fsdp"), (95, "torch_distributed")])
def test_a_new_framework_folder_exporting_only_its_spec_is_found_and_asked_in_its_precedence_order(
    hooks_folder, precedence, asked_before
):
    """Nothing but the folder names it: the registry finds it, and the adapter choice asks it
    before torch_optim (whose adapter fits any optimizer) only when its precedence says so."""
    _write_package(
        hooks_folder, "new_framework", NEW_FRAMEWORK.format(name="new_framework", trigger="x", precedence=precedence)
    )
    names = [spec.name for spec in registry.frameworks()]
    assert names[names.index("new_framework") + 1] == asked_before
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # held here: adapters hold it weakly
    family = adapter_choice.adapter_for(optimizer).family
    assert family == ("new_framework" if precedence < registry.load("torch_optim").precedence else "torch")


def _enable_in_a_new_process(folder: Path, config: str, then: str = "") -> subprocess.CompletedProcess:
    """hooks.enable in a fresh process (it switches the real instrumentors on for good) with
    `folder` on msmon.hooks.__path__, torch already imported (as by a script); prints the
    session's events and the packages switched on, before and after running `then`."""
    code = textwrap.dedent(
        f"""
        import torch
        from msmon import hooks
        hooks.__path__.append({str(folder)!r})
        events = []
        session = hooks.Session.from_file({config!r}, build_monitor=lambda path: None)
        session.listeners.append(lambda event, info: events.append(event))
        hooks.enable(session)
        print(events, sorted(hooks._enabled))
        {then}
        print(events, sorted(hooks._enabled))
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=folder.parent)


def test_a_new_framework_folder_is_switched_on_when_its_library_is_imported_in_precedence_order(
    hooks_folder, write_config
):
    """Two new packages switched on by the same import: asked by precedence, not by name; the
    libraries already imported (torch) switched theirs on right away."""
    _write_package(
        hooks_folder,
        "alpha_framework",
        NEW_FRAMEWORK.format(name="alpha_framework", trigger="new_library", precedence=95),
    )
    _write_package(
        hooks_folder, "zeta_framework", NEW_FRAMEWORK.format(name="zeta_framework", trigger="new_library", precedence=5)
    )
    (hooks_folder.parent / "new_library.py").write_text("")
    out = _enable_in_a_new_process(hooks_folder, write_config({}), then="import new_library").stdout.splitlines()
    assert out == [
        "[] ['torch_distributed', 'torch_optim']",
        "['zeta_framework switched on', 'alpha_framework switched on'] "
        "['alpha_framework', 'torch_distributed', 'torch_optim', 'zeta_framework']",
    ]


@pytest.mark.parametrize(
    ("init", "reason"),
    [
        ("FRAMEWORK = {'name': 'fake_framework'}  # the untyped shape of old", "not a Framework"),
        ("", "exports no FRAMEWORK"),
    ],
)
def test_a_package_exporting_no_framework_spec_is_reported_and_the_others_switch_on(
    hooks_folder, write_config, monkeypatch, caplog, init, reason
):
    _write_package(hooks_folder, "fake_framework", init)
    monkeypatch.setattr(hooks, "_enabled", {})
    session = hooks.Session.from_file(write_config({}), TrainerMon)
    with caplog.at_level(logging.ERROR, logger="msmon"):
        assert not hooks.instrument("fake_framework", session)
    assert any(
        "fake_framework cannot be imported" in r.getMessage() and reason in r.getMessage() for r in caplog.records
    )
    with pytest.raises(TypeError, match=reason):
        registry.load("fake_framework")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="msmon"):
        assert "fake_framework" not in [spec.name for spec in registry.frameworks()]
        assert len(registry.frameworks()) == len(registry.package_names()) - 1  # reported once: the answer is kept
    assert [r.getMessage().count("fake_framework cannot be imported") for r in caplog.records] == [1]
    run = _enable_in_a_new_process(hooks_folder, write_config({}))
    assert run.stdout.splitlines() == ["[] ['torch_distributed', 'torch_optim']"] * 2
    assert run.stderr.count("fake_framework cannot be imported") == 1 and reason in run.stderr


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
    switched_on = []
    _fake_package(
        monkeypatch,
        Framework(
            name="fake_framework",
            switched_on_by="fake_framework",  # where the version is read when the distribution is not installed
            precedence=50,
            distribution="msmon-fake-framework",  # not installed: the version is its module's __version__
            supported=">=1.0,<2.0",
            instrument=switched_on.append,
            uninstrument=lambda: None,
        ),
    )
    library = types.ModuleType("fake_framework")
    library.__version__ = "2.5.0"
    monkeypatch.setitem(sys.modules, "fake_framework", library)
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
    from msmon.seams.patching import wrap_method

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
    from msmon.seams.patching import Replacements

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

    lib = importlib.import_module(library)  # every library here is in msmon[test]
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
