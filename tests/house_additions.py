"""The four additions the house promises to take with no line outside their own file or folder:
a statistic (one entry in stats/ops.py), an output format (one sink file), a CLI verb (one
command file) and a framework (one folder). `write_additions` writes them into a copy of msmon's
source; tests/unit/test_house_promises.py runs the registry-driven test files against that copy."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

NEW_OP = "absmean"
NEW_FORMAT = "jsonl"
NEW_VERB = "tail"
NEW_FRAMEWORK = "colossal"

# appended to stats/ops.py (a statistic is one entry of its table)
OP_ENTRY = f"""

register(Op("{NEW_OP}", "{NEW_OP}", "{NEW_OP}", True, "average", count_weighted_mean,
            compute=lambda x, acc: x.abs().sum(dtype=acc)))
"""

FILES = {
    f"output/sinks/{NEW_FORMAT}_sink.py": f'''
        """One JSON line per recorded tensor and step."""

        from __future__ import annotations

        import json
        import os
        from typing import Any

        from ...records.rows import StepRecord
        from . import sink_format
        from .base import Sink


        @sink_format("{NEW_FORMAT}")
        class JsonlSink(Sink):
            writes_files = True

            def __init__(self, path: str) -> None:
                self.file = open(path, "a")

            @classmethod
            def for_rank(cls, log_dir: str, config: Any) -> JsonlSink:
                return cls(os.path.join(log_dir, "steps.jsonl"))

            def write(self, record: StepRecord) -> None:
                for key, values in zip(record.keys, record.values):
                    line = {{"step": record.step, "tag": key.tag(record.rank), **dict(zip(record.ops, values))}}
                    self.file.write(json.dumps(line) + "\\n")

            def flush(self) -> None:
                self.file.flush()

            def close(self) -> None:
                self.file.close()
        ''',
    f"launcher/{NEW_VERB}_command.py": f'''
        """`msmon {NEW_VERB}`: the last recorded step of every rank."""

        from __future__ import annotations

        import click


        @click.command("{NEW_VERB}")
        @click.argument("directory", type=click.Path(exists=True, file_okay=False))
        def {NEW_VERB}(directory: str) -> None:
            """Print the last recorded step of every rank."""
            click.echo(directory)
        ''',
    f"hooks/{NEW_FRAMEWORK}/__init__.py": f'''
        """ColossalAI: its folder and nothing else."""

        from __future__ import annotations

        from typing import Any

        from ...seams.spec import Framework


        def instrument(session: Any) -> None:
            from ...seams.library import library

            library("{NEW_FRAMEWORK}ai_library")


        def uninstrument() -> None:
            pass


        def adapter_for(optimizer: Any) -> None:
            return None


        FRAMEWORK = Framework(
            name="{NEW_FRAMEWORK}",
            switched_on_by="{NEW_FRAMEWORK}ai_library",
            precedence=40,
            distribution="{NEW_FRAMEWORK}ai",
            supported=">=0.4,<0.5",
            instrument=instrument,
            uninstrument=uninstrument,
            adapter_for=adapter_for,
        )
        ''',
}


def write_additions(root: Path) -> Path:
    """A copy of this checkout's source tree, lint configuration and tests under `root`, with the
    four additions written into its msmon; returns the copy's root."""
    here = Path(__file__).resolve().parents[1]
    shutil.copytree(here / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(here / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("tools", "examples", "docs", "benchmarks"):
        shutil.copytree(here / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in (".importlinter", "pyproject.toml", "Makefile", "README.md"):
        shutil.copy(here / name, root / name)
    package = root / "src" / "msmon"
    with open(package / "stats" / "ops.py", "a") as ops:
        ops.write(OP_ENTRY)
    for path, text in FILES.items():
        target = package / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text).lstrip())
    return root
