"""Where statistics go: one file per output format, `<format>_sink.py`, registering its Sink class here.

The file's name is the format's name: the config's `format` names it, and this registry knows
every format from the file names alone, without importing them (they import torch), so that
`msmon run` refuses an unknown format before the job starts without loading torch. The config
checks only the shape of `format` (it sits below the output and does not know the sinks); the
names are checked here, by `check_formats`, where a config is loaded for use (TrainerMon, the hot
reload, the launcher). A sink file declares its Sink class with `@sink_format("name")`, which
holds it to its file's name; the rank output builds its sinks from this registry, so a new format
is one file in this folder. The sink files load when sinks are first built: importing this
package loads none of them (nor torch). A format that needs an optional package says so in its
file, `REQUIRES = {"pyarrow": "msmon[parquet]"}`, read from the text (`required_modules`), so
that `check_formats` refuses it before training when the package is missing, never mid-run.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil
from typing import TYPE_CHECKING, Callable, TypeVar

from ...config import ConfigError, did_you_mean
from ...system.short_repr import short_repr
from .base import Sink

if TYPE_CHECKING:
    from ...config import MonitorConfig

__all__ = [
    "Sink",
    "sink_format",
    "format_names",
    "check_formats",
    "required_modules",
    "registered_formats",
    "sink_class",
    "build_sinks",
]

SINK_FILE_SUFFIX = "_sink"  # `csv_sink.py` writes `format: csv`
_S = TypeVar("_S", bound=type[Sink])
_REGISTRY: dict[str, type[Sink]] = {}


def sink_format(name: str) -> Callable[[_S], _S]:
    """Register a Sink class as the writer of `format: name` (its log lines name it so too); it
    must live in `<name>_sink.py`, the file the format's name is known by before it is imported."""

    def register(cls: _S) -> _S:
        module = cls.__module__.rsplit(".", 1)[-1]
        if module != name + SINK_FILE_SUFFIX:
            raise ValueError(
                f"output format {name!r} must be written by a sink file named {name + SINK_FILE_SUFFIX}.py, "
                f"not {module}.py: the config's format names are the sink files' names"
            )
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"output format {name!r} is registered twice: {_REGISTRY[name]} and {cls}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def format_names() -> list[str]:
    """The name of every output format, in alphabetical order: one per `<format>_sink.py` in this
    folder, read from the file names without importing them (no torch)."""
    suffix = SINK_FILE_SUFFIX
    return sorted(m.name[: -len(suffix)] for m in pkgutil.iter_modules(__path__) if m.name.endswith(suffix))


def check_formats(config: MonitorConfig, path: str | os.PathLike | None = None) -> None:
    """Refuse a config whose `format` names no sink file, or a format whose optional package is
    not installed, before training (or before a hot reload takes it), with the closest name or
    what to install; `path`, the config file's, prefixes the message as the config's own errors do."""
    known = format_names()
    for name in config.format:
        message = None
        if name not in known:
            message = f"format: unknown format {short_repr(name)}; expected {known}{did_you_mean(name, known)}"
        else:
            missing = [(m, extra) for m, extra in required_modules(name).items() if not _installed(m)]
            if missing:
                module, extra = missing[0]
                message = f"format: {name!r} needs {module}, which is not installed: pip install '{extra}'"
        if message is not None:
            raise ConfigError(f"{path}: {message}" if path is not None else message)


def required_modules(name: str) -> dict[str, str]:
    """{module: what to pip install} that format `name` needs beyond msmon's own dependencies: the
    literal `REQUIRES = {...}` of its sink file, read from the file's text without importing it
    (no torch, no optional package), so that a missing one is a config error before training."""
    paths = [os.path.join(folder, f"{name}{SINK_FILE_SUFFIX}.py") for folder in __path__]
    path = next((p for p in paths if os.path.isfile(p)), paths[0])
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REQUIRES" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    return {}


def _installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def sink_class(name: str) -> type[Sink]:
    """The Sink class of format `name`, its file imported now (and only its file: a format the
    config does not name never loads its packages, pyarrow's threads say)."""
    importlib.import_module(f"{__name__}.{name}{SINK_FILE_SUFFIX}")
    if name not in _REGISTRY:
        raise ValueError(f"output/sinks/{name}{SINK_FILE_SUFFIX}.py declares no Sink with @sink_format({name!r})")
    return _REGISTRY[name]


def registered_formats() -> dict[str, type[Sink]]:
    """{format name: Sink class} of every sink file in this folder (each imported)."""
    return {name: sink_class(name) for name in format_names()}


def build_sinks(formats: list[str], log_dir: str, config: MonitorConfig) -> list[Sink]:
    """The sinks of the config's `format` (its names checked by `check_formats`), in its order."""
    return [sink_class(name).for_rank(log_dir, config) for name in formats]
