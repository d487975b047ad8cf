"""numpy's transparent huge pages off while the report folds its values.

numpy asks the kernel for huge pages (madvise) on every array of a few MiB; where the kernel
answers that by compacting memory on the first touch (THP `defrag = madvise`, Debian's default),
each fresh array of a few hundred MiB costs about a second before it holds a value: a report of
512 ranks lost 2-3 s of its 20 that way. The fold's arrays are filled once and read a few times,
so small pages cost it nothing. The setting is numpy's (private, on numpy >= 1.20: a no-op
where it is missing) and is put back as it was.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def small_pages() -> Iterator[None]:
    switch = None
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            switch = getattr(importlib.import_module(name), "_set_madvise_hugepage", None)
            break
        except ImportError:
            continue
    if switch is None:
        yield
        return
    before = switch(False)
    try:
        yield
    finally:
        switch(before)
