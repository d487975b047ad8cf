"""Which backward passes DistributedDataParallel all-reduces, per monitored parameter.

DDP reduces a parameter's `.grad` in place during every backward whose forward ran with
gradient synchronisation on (outside `no_sync()`), so after such a micro-batch `.grad` no
longer holds the rank-local gradient. DDP decides this per forward and leaves the decision in
`require_forward_param_sync` (set at the end of each forward under grad mode), which is what
this reads at backward time; a DDP mode that does not set it (compiled DDP, all parameters
delayed) keeps its initial True, which errs on the side of a copy, never of a wrong value.

The DDP modules are found among the model chunks, else once among all live objects (the
launcher may attach to the inner model before the script wraps it); references are weak.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch built without distributed
        return None
    return DistributedDataParallel


class DdpSync:
    """Answers `reduces(param)`: will the backward now running all-reduce this parameter's `.grad`?"""

    def __init__(self, chunks: Iterable[torch.nn.Module], param_ids: set[int]) -> None:
        self._param_ids = param_ids
        self._of: dict[int, weakref.ref] = {}  # id(param) -> its DDP module
        self._searched_memory = False
        cls = _ddp_class()
        if cls is not None:
            self._index(m for chunk in chunks for m in chunk.modules() if isinstance(m, cls))

    def _index(self, ddps: Iterable[torch.nn.Module]) -> None:
        for ddp in ddps:
            ref = weakref.ref(ddp)
            for p in ddp.parameters():
                if id(p) in self._param_ids:
                    self._of[id(p)] = ref

    def _search_memory(self) -> None:
        """Once: DDP modules built around the model after the monitor attached."""
        self._searched_memory = True
        cls = _ddp_class()
        if cls is not None:
            # type(), not isinstance(): isinstance asks a dead weak proxy for __class__ and raises
            self._index(o for o in gc.get_objects() if issubclass(type(o), cls))

    def reduces(self, param: torch.Tensor) -> bool:
        ref = self._of.get(id(param))
        if ref is None and not self._searched_memory:
            self._search_memory()
            ref = self._of.get(id(param))
        ddp = ref() if ref is not None else None
        return ddp is not None and bool(getattr(ddp, "require_forward_param_sync", True))
