"""Side files (`replica_check.json`, `stack_info.csv`, `module_struct.json`): the one call a
collector writes a file through, so that collectors hold no file handling of their own.

Written atomically: the text goes to `<name>.tmp` beside the file, then `os.replace` puts it in
place. Whoever reads the file meanwhile (a user's `cat` while the job runs, the offline tools
after a crash) sees the previous whole file or the new whole file, never half of one; the
replica check rewrites its report at every check, from two threads, so a plain write would
leave a truncated report behind a crash. A failed write leaves the previous file untouched and
removes its temporary file.
"""

from __future__ import annotations

import contextlib
import os


def write_artifact(directory: str, name: str, text: str, *, make_directory: bool = False) -> str:
    """Write `text` to `directory/name` atomically, as UTF-8 with its newlines as given (no
    translation: the bytes on disk are the text's); return the path. `make_directory` creates
    `directory` first. Raises OSError when the file cannot be written."""
    if make_directory:
        os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path
