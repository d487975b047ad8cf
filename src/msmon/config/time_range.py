"""`append_output`'s value: `[]` or `[start, end]`, two time prefixes of output directory names.

The prefix is the one the output writes at the head of each rank directory's name
(`%b%d_%H-%M-%S`, msprobe's layout); it is declared here, at the bottom, so that the config
checks the range before training starts and the output names and finds directories by it,
without the config importing the output.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..system.short_repr import short_repr
from .errors import ConfigError

TIME_FORMAT = "%b%d_%H-%M-%S"  # the local time a rank directory was made, at the head of its name


def parse_time(text: Any, where: str) -> datetime:
    if not isinstance(text, str):
        raise ConfigError(f'{where}: expected a time prefix like "Dec03_21-34-40", got {short_repr(text)}')
    try:
        return datetime.strptime(text, TIME_FORMAT)
    except ValueError:
        raise ConfigError(
            f"{where}: {short_repr(text)} is not a time prefix of an output directory "
            f'(format %b%d_%H-%M-%S, like "Dec03_21-34-40")'
        ) from None


def parse_time_range(value: Any, key: str = "append_output") -> list[str | None]:
    """`[]` (off) or `[start, end]`; an end may be null (open). Raises ConfigError."""
    if not isinstance(value, list) or len(value) not in (0, 2):
        raise ConfigError(
            f'{key}: expected [] or two time prefixes ["Dec03_21-34-40", "Dec03_21-34-42"], got {short_repr(value)}'
        )
    if not value:
        return []
    if value[0] is None and value[1] is None:
        raise ConfigError(f"{key}: at least one end of the range must be a time prefix, got {short_repr(value)}")
    times = [None if v is None else parse_time(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if times[0] is not None and times[1] is not None and times[0] > times[1]:
        raise ConfigError(f"{key}: the start {short_repr(value[0])} is later than the end {short_repr(value[1])}")
    return list(value)
