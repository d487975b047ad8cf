"""A new `msmon` verb is one file: the CLI finds every `launcher/<verb>_command.py` and adds the
commands it defines (a group's subcommands stay under their group)."""

from __future__ import annotations

import sys
import textwrap

import click
from click.testing import CliRunner

from msmon.launcher import cli


def test_the_msmon_group_has_exactly_the_commands_of_the_verb_files():
    """One command (or group) per verb file, a new one's included; msmon's own among them."""
    files = sorted(p.stem for p in cli.Path(cli.__file__).parent.glob("*_command.py"))
    assert len(cli.main.commands) == len(files)
    assert {"analyse", "build-native", "convert", "db", "diff", "export", "report", "run", "struct"} <= set(
        cli.main.commands
    )
    assert sorted(cli.main.commands["convert"].commands) == ["csv2tb", "tb2csv"]


def test_a_verb_file_dropped_in_the_folder_becomes_a_command_and_other_files_do_not(tmp_path, monkeypatch):
    package = tmp_path / "verbs_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello_command.py").write_text(
        textwrap.dedent(
            """
            import click

            @click.command("hello")
            @click.argument("name")
            def hello(name):
                "Say hello."
                click.echo(f"hello {name}")
            """
        )
    )
    (package / "helpers.py").write_text("import click\n\n@click.command('not-a-verb')\ndef nope():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = cli.verb_commands(package, "verbs_pkg")
    assert [c.name for c in found] == ["hello"]
    group = click.Group("msmon", commands={c.name: c for c in found})
    result = CliRunner().invoke(group, ["hello", "rank0"])
    assert result.exit_code == 0 and result.output == "hello rank0\n"
    sys.modules.pop("verbs_pkg.hello_command", None)
