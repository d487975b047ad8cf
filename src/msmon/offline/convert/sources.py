"""The rank directories a conversion reads, where it writes, and its progress bars."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from ...output.resume import rank_dirs
from ...records.layout import CONFIG_FILE, RANK_DIR
from ...records.runs import RunChoiceError, choice_lines, choose_run, group_runs

MSPROBE_RANK = re.compile(r"^rank(?P<rank>\d+)$")

Progress = Callable[..., Any]  # tqdm-like: progress(total=, desc=, unit=, unit_scale=) -> object with update/close


@dataclass(frozen=True)
class RankSource:
    """One rank's output directory and the name of its counterpart in the output."""

    rank: int
    path: str
    name: str


class ConvertError(ValueError):
    """Nothing to convert, or a place that cannot be written."""


def find_ranks(path: str, time_start: str | None = None, time_end: str | None = None) -> list[RankSource]:
    """The rank directories under `path` (a monitor output directory, or one rank directory)
    whose time prefix lies in [time_start, time_end]; msprobe's converted `rank{r}` folders too."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    match = RANK_DIR.match(base) or MSPROBE_RANK.match(base)
    if match:
        return [RankSource(int(match["rank"]), path, base)]
    time_range = [time_start, time_end] if (time_start or time_end) else None
    sources = [
        RankSource(rank, d, os.path.basename(d)) for rank, dirs in rank_dirs(path, time_range).items() for d in dirs
    ]
    if not sources and time_range is None:
        for name in sorted(os.listdir(path)):
            m = MSPROBE_RANK.match(name)
            if m and os.path.isdir(os.path.join(path, name)):
                sources.append(RankSource(int(m["rank"]), os.path.join(path, name), name))
    if not sources:
        raise ConvertError(
            f"no rank directory (<%b%d_%H-%M-%S>-rank<r>-<id>) under {path}"
            + (f" with a time prefix between {time_start} and {time_end}" if time_range else "")
        )
    return sorted(sources, key=lambda s: (s.rank, s.name))


def one_per_rank(sources: list[RankSource], path: str) -> None:
    """msprobe's layout holds one directory per rank (`rank{r}/{category}/`): refuse, before
    writing anything, a folder holding several runs of a rank."""
    seen: dict[int, list[str]] = {}
    for source in sources:
        seen.setdefault(source.rank, []).append(source.name)
    several = {rank: names for rank, names in seen.items() if len(names) > 1}
    if several:
        rank, names = min(several.items())
        raise ConvertError(
            f"{path} holds {len(names)} directories of rank {rank} ({', '.join(names)}): msprobe's layout "
            "(--tags msprobe) has one folder per rank; pick one run with --time-start/--time-end or -d "
            "<rank directory>, or keep msmon's tags (--tags msmon), which convert each directory apart"
        )


def of_run(sources: list[RankSource], run: str | None, verb: str) -> tuple[list[RankSource], list[str]]:
    """The sources of the run `run` (None: the newest; "all": every one), and the lines that
    name it and the others (records/runs.py)."""
    try:
        chosen, others = choose_run(group_runs({s.path: s.rank for s in sources}), run)
    except RunChoiceError as exc:
        raise ConvertError(str(exc)) from None
    if chosen is None:
        return sources, []
    kept = set(chosen.dirs)
    return [s for s in sources if s.path in kept], choice_lines(chosen, others, verb)


def default_output(path: str, what: str) -> str:
    """`<monitor output>/<now>-<what>`, beside the rank directories (msprobe's default)."""
    path = os.path.abspath(path)
    if RANK_DIR.match(os.path.basename(path)) or MSPROBE_RANK.match(os.path.basename(path)):
        path = os.path.dirname(path)
    return os.path.join(path, f"{datetime.now().strftime('%b%d_%H-%M-%S')}-{what}")


def fresh_dir(path: str) -> str:
    if os.path.isdir(path) and os.listdir(path):
        raise ConvertError(f"{path} exists and is not empty; choose another output directory")
    os.makedirs(path, exist_ok=True)
    return path


def rank_config(directory: str) -> dict:
    try:
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def no_progress(**_kwargs: Any) -> Any:
    class _Quiet:
        def update(self, _n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Quiet()
