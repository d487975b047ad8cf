"""`python -m msmon.launcher ...`: the `msmon` command, for environments without its script."""

from .cli import main

main(prog_name="msmon")
