"""`msmon build-native`: build the one-pass CPU statistics kernel ahead of the first monitor."""

from __future__ import annotations

import os

import click


@click.command("build-native")
def build_native() -> None:
    """Build the one-pass CPU statistics kernel now (a C++ compiler, a few seconds).

    Monitors build it themselves on first use; this does it ahead of time, e.g. on a login node
    whose cache ($MSMON_CACHE_DIR, else ~/.cache/msmon) the compute nodes share.
    MSMON_NATIVE_STATS=0 turns it off."""
    from ..stats import native

    os.environ[native.ENV] = "1"
    if native.load() is None:
        raise click.ClickException(
            "the native statistics could not be built (see the error above); monitors keep using torch reductions"
        )
    how = f"built in {native.build_seconds:.1f} s" if native.compiled_here else "already built"
    click.echo(f"msmon: native statistics {how} ({native.isa()} loop on this CPU): {native.built_path()}")
