"""The hooks' place in msmon's layers (issue 32): the instrumentors sit below the api, so the
monitor they attach is built by a factory the layer above gives the Session (the launcher's
in-job start-up gives the api's TrainerMon), and the seams (spec, registry, adapters, the
collective-call listener API: seams/) sit below the collectors and the runtime, so they import no
instrumentor. Imports are read from the source: function-level imports and TYPE_CHECKING
blocks included."""

from __future__ import annotations

import torch

from conftest import MLP
from import_walk import PACKAGE
from import_walk import module_name as _module_name
from import_walk import msmon_imports as _msmon_imports
from msmon import TrainerMon
from msmon.hooks import Session, torch_optim

HOOKS = PACKAGE / "hooks"
# the instrumentors outside the library packages
INSTRUMENTORS = ("msmon.hooks.attach", "msmon.hooks.handover", "msmon.hooks.explicit", "msmon.hooks.automatic")


def _is_in(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _library_packages() -> tuple[str, ...]:
    """msmon.hooks.<library>: one folder per instrumented library."""
    return tuple(f"msmon.hooks.{p.name}" for p in sorted(HOOKS.iterdir()) if (p / "__init__.py").is_file())


def test_no_module_of_the_hooks_imports_the_api_it_sits_below():
    upward = {
        _module_name(path): sorted(m for m in _msmon_imports(path) if m == "msmon.api" or m.startswith("msmon.api."))
        for path in sorted(HOOKS.rglob("*.py"))
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}


def test_the_seams_import_no_instrumentor_and_no_library_package():
    """The seams import nothing of msmon.hooks (not the Session's package either: the
    instrumentors' shared state); nor anything else above them."""
    libraries = _library_packages()
    assert {"msmon.hooks.torch_optim", "msmon.hooks.torch_distributed", "msmon.hooks.deepspeed"} <= set(libraries)
    above = (*INSTRUMENTORS, *libraries, "msmon.api", "msmon.launcher", "msmon.collectors")

    def is_above(name: str) -> bool:
        return _is_in(name, above) or name == "msmon.hooks" or name.startswith("msmon.hooks.")

    upward = {
        _module_name(path): sorted(m for m in _msmon_imports(path) if is_above(m))
        for path in sorted((PACKAGE / "seams").rglob("*.py"))
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}


def test_no_collector_imports_an_instrumentor_or_a_library_package_of_the_hooks():
    above = (*INSTRUMENTORS, *_library_packages())
    upward = {
        _module_name(path): sorted(m for m in _msmon_imports(path) if _is_in(m, above))
        for path in sorted((PACKAGE / "collectors").rglob("*.py"))
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}


def test_the_session_builds_each_monitor_with_the_factory_it_was_given(write_config, output_dir):
    """The torch.optim instrumentor attaches what the Session's monitor factory builds, from the
    session's config file, and closes it when the optimizer goes: nothing in hooks/ names the api."""
    built: list[tuple[str, TrainerMon]] = []

    def build_monitor(config_path: str) -> TrainerMon:
        monitor = TrainerMon(config_path)
        built.append((config_path, monitor))
        return monitor

    session = Session.from_file(write_config({"wg_distribution": True, "format": "csv"}), build_monitor)
    torch_optim.instrument(session)
    try:
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert [(path, monitor) for path, monitor in built] == [(session.config_path, session.monitors[0])]
        assert session.monitors[0].models == [model] and session.monitors[0].attached
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        assert session.monitors[0].steps_recorded == 1
    finally:
        torch_optim.uninstrument()
        for monitor in list(session.monitors):
            monitor.close()
