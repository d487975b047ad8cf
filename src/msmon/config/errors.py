"""The one error type of the config: every mistake in a config, found before training starts.

A ValueError, so that a caller catching bad values catches it too; its message is one line that
names the key, what was expected and what was given (parsing.py, text.py).
"""

from __future__ import annotations

import difflib
from typing import Any


class ConfigError(ValueError):
    """A config mistake, found before the first training step."""


def did_you_mean(word: Any, choices: Any) -> str:
    """ " (did you mean 'x'?)" naming the choices closest to a mistyped name, or "" if none is close."""
    if not isinstance(word, str):  # a YAML key can be a number, a date or null
        return ""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
