"""A value's repr for an error message, cut short: a config value can be huge (a YAML alias
expanding a few lines into billions of elements), and formatting all of it would take minutes
and gigabytes before the one line that says what is wrong."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40
_MAX_CHARS = 300


def short_repr(value: Any) -> str:
    """repr(value) for small values; for large ones the first elements, levels and characters, with `...`."""
    text = _REPR.repr(value)
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."
