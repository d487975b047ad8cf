"""The one error type of the config: every mistake in a config, found before training starts.

A ValueError, so that a caller catching bad values catches it too; its message is one line that
names the key, what was expected and what was given (parsing.py, text.py).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config mistake, found before the first training step."""
