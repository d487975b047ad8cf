"""What stops a comparison before it answers (exit code 2): bad input, or two runs that cannot
be compared. Each is one line for the command line, never a traceback."""

from __future__ import annotations


class DiffInputError(Exception):
    """An input cannot be read: a missing directory, a run id that does not exist, a corrupt
    CSV file or database, a bad --map file."""


class Incomparable(Exception):
    """The two runs cannot be compared (a different model)."""
