"""Where statistics go: one file per output format, `<format>_sink.py`, registering its Sink class here.

The file's name is the format's name: the config's `format` names it, and this registry knows
every format from the file names alone, without importing them (they import torch), so that
`msmon run` refuses an unknown format before the job starts without loading torch. The config
checks only the shape of `format` (it sits below the output and does not know the sinks); the
names are checked here, by `check_formats`, where a config is loaded for use (TrainerMon, the hot
reload, the launcher). A sink file declares its Sink class with `@sink_format("name")`, which
holds it to its file's name; the rank output builds its sinks from this registry, so a new format
is one file in this folder. The sink files load when sinks are first built: importing this
package loads none of them (nor torch). A sink that needs a package users install apart (a
tracker's client) names it at the top of its file, `CLIENT = "wandb"` and `EXTRA = "wandb"` (the
pip extra that brings it), read from the file's text by `check_formats`, so that a missing client
is refused before the job starts, never in the middle of it.
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
    "format_client",
    "check_formats",
    "registered_formats",
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
    """Refuse a config whose `format` names no sink file, before training (or before a hot
    reload takes it), with the closest name; `path`, the config file's, prefixes the message as
    the config's own errors do."""
    known = format_names()
    for name in config.format:
        message = None
        if name not in known:
            message = f"format: unknown format {short_repr(name)}; expected {known}{did_you_mean(name, known)}"
        else:
            client = format_client(name)
            if client is not None and importlib.util.find_spec(client[0]) is None:
                message = (
                    f"format: {name!r} needs the {client[0]} package, which is not installed here: "
                    f"pip install 'msmon[{client[1]}]'"
                )
        if message is not None:
            raise ConfigError(f"{path}: {message}" if path is not None else message)


def format_client(name: str) -> tuple[str, str] | None:
    """(package, pip extra) a format's sink file names as `CLIENT` and `EXTRA`, read from its text
    without importing it; None when it needs none."""
    spec = importlib.util.find_spec(f"{__name__}.{name}{SINK_FILE_SUFFIX}")
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), spec.origin)
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("CLIENT", "EXTRA") and isinstance(node.value, ast.Constant):
                found[node.targets[0].id] = str(node.value.value)
    return (found["CLIENT"], found.get("EXTRA", found["CLIENT"])) if "CLIENT" in found else None


def registered_formats() -> dict[str, type[Sink]]:
    """{format name: Sink class} of every sink file in this folder."""
    for name in format_names():
        importlib.import_module(f"{__name__}.{name}{SINK_FILE_SUFFIX}")
        if name not in _REGISTRY:
            raise ValueError(f"output/sinks/{name}{SINK_FILE_SUFFIX}.py declares no Sink with @sink_format({name!r})")
    return dict(_REGISTRY)


def build_sinks(formats: list[str], log_dir: str, config: MonitorConfig) -> list[Sink]:
    """The sinks of the config's `format` (its names checked by `check_formats`), in its order."""
    known = registered_formats()
    return [known[name].for_rank(log_dir, config) for name in formats]
