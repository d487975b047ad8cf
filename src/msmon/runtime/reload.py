"""Config hot reload: notice an edit of the config file between steps and agree on it.

Between steps the file's identity (mtime, size, inode: a `stat`, nothing more) is compared with
the version in force; a new version is read, validated against the model, and proposed to the
agreement round (agreement.py: with sharded statistics, every rank switches at the same step;
without, the edit just read is agreed at once). Applying the agreed config is the step's
(step.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

from ..config import ConfigError, MonitorConfig, load_config
from ..output.sinks import check_formats

if TYPE_CHECKING:
    from .shards import ShardCombiner
from . import agreement

logger = logging.getLogger("msmon")

# settings whose change needs a new writer (the sinks are made from them)
OUTPUT_KEYS = ("format", "tensorboard_layout", "ndigits", "step_count_per_record", "alert", "category_ops")


def identity(path: str) -> tuple[int, ...] | None:
    """What tells one version of a file from the next: mtime, size and inode (two writes in
    one mtime tick differ in size; an editor's save-by-rename makes a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def output_changed(old: MonitorConfig, new: MonitorConfig) -> bool:
    """Whether the edit changes how rows are written (the writer is restarted)."""
    return any(getattr(new, k) != getattr(old, k) for k in OUTPUT_KEYS)


class ConfigReload:
    """The config file's versions: the one in force, the last bad one, the agreement round."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.ident = identity(path)  # the file version in force (or proposed)
        self.bad_ident: tuple[int, ...] | None = None  # the last version found invalid
        self.agreement = agreement.ConfigAgreement()  # over the shard groups once attached

    def attach(self, combiner: ShardCombiner, adapter: Any) -> None:
        """Ranks combining shards switch configs together (agreement.for_shards)."""
        self.agreement = agreement.for_shards(combiner, adapter, self.rank)

    def at_step_end(self, stamped: Any, check_fits: Callable[[MonitorConfig], None]) -> MonitorConfig | None:
        """At a step's end: complete this step's agreement round, look for a new edit of the
        file, and return the edit the ranks agreed on (or None)."""
        self.agreement.end_round(stamped)
        edit = self.read_edit(check_fits)
        if edit is not None:
            self.agreement.propose(edit)
        return self.agreement.decide()

    def read_edit(self, check_fits: Callable[[MonitorConfig], None]) -> MonitorConfig | None:
        """The config file's new version, validated against the model by `check_fits`, or None:
        unchanged, missing, changing while read, or known to be bad. A bad version, whatever is
        wrong with it, is logged once in one line and leaves the config in force alone; a later
        version is read again."""
        path = self.path
        ident = identity(path)
        if ident is None or ident == self.ident or ident == self.bad_ident:
            return None
        try:
            new = load_config(path, allow_empty=False)  # empty: an editor half-way through writing it
            check_formats(new, path)
            check_fits(new)
        except Exception as exc:
            failure: BaseException | None = exc
        else:
            failure = None
        if identity(path) != ident:
            return None  # written to while read: read it again at the next step
        if failure is not None:
            self.bad_ident = ident
            logger.error(
                "msmon[rank %d]: the edited config is invalid and is ignored (the previous config stays in force): %s",
                self.rank,
                one_line(failure),
            )
            return None
        self.ident, self.bad_ident = ident, None
        return new
