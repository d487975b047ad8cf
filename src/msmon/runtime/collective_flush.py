"""Under torch.distributed, read the noted tensors before a collective writes into one of them.

A collective writes its result into the caller's tensors without moving their version counter
(`dist.all_reduce(t)` leaves `t._version` as it was), so the batch point's check (same version,
same storage) cannot see it: Megatron's reduce-from-tensor-parallel-region all-reduces a tensor
in place, and in backward its copy-to region all-reduces an incoming gradient in place. While
tensors are noted (msmon.runtime.hook_batch), this listener of the wrapped collectives
(msmon.seams.collective_listeners) reads the batch before any collective whose tensors share
storage with a noted one, so each row is of the value its hook saw, and forgets the rows kept for
those tensors (msmon.runtime.tensor_memo), so that a hook meeting the same tensor object after the
collective (a gradient reduced in place and handed on) reads the new value. Held only where batching
runs and more than one process is in the job: on a single process nothing is wrapped.
"""

from __future__ import annotations

from ..seams import collective_listeners as cc
from ..seams.collective_calls import CollectiveCall
from .hook_batch import HookBatch


class FlushBeforeCollectives:
    __slots__ = ("_batch", "_held")

    def __init__(self, batch: HookBatch) -> None:
        self._batch = batch
        self._held = False

    def start(self) -> None:
        self._batch.track_storage = True
        self._held = cc.acquire()
        cc.add_listener(self)

    def stop(self) -> None:
        self._batch.track_storage = False
        cc.remove_listener(self)
        if self._held:
            self._held = False
            cc.release()

    def wants(self) -> bool:
        return self._batch.tracks_any()

    def on_launch(self, call: CollectiveCall) -> bool:
        self._batch.before_collective(call.inputs + call.outputs)
        return False

    def on_complete(self, call: CollectiveCall) -> None:
        return None
