"""Rank-local gradient sums kept apart from a `.grad` that DDP reduces in place.

When DDP reduces a micro-batch that is not the step's last (accumulation without `no_sync()`),
or when the gradient agreement needs the local gradient beside the reduced one, `.grad` stops
holding the rank-local gradient at the reduction: a copy of it is taken right before, and each
later micro-batch's incoming gradient is added to the copy in a tensor hook (it sees the
gradient before it is accumulated). The hook exists only while the copy does. For the
agreement the copy goes into its place in flat buffers kept across steps
(agreement.LocalCopies). A parameter this rank did not use while DDP reduced it
(`find_unused_parameters`) starts from a zero sum (unused_params.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .agreement import LocalCopies
from .tensors import unserializable

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


class LocalSums:
    """The sums by parameter index (`local`), and the hooks that add to them."""

    def __init__(self, guard: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._guard = guard  # the collector's: a failing hook switches it off, never the training
        self.local: dict[int, torch.Tensor] = {}
        self._adding: dict[int, RemovableHandle] = {}

    def keep(
        self,
        index: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        copies: LocalCopies | None,
        more: bool = True,
        zero: bool = False,
    ) -> torch.Tensor:
        """Keep `grad` apart (a zero sum shaped like it, with `zero`), in its place in `copies`
        when given, and (when `more` micro-batches may follow) add each later one's gradient."""
        if copies is not None:
            local = copies.zeros(index, grad) if zero else copies.copy(index, grad)
        else:
            local = torch.zeros_like(grad) if zero else grad.detach().clone()
        self.local[index] = local
        if more:

            def on_incoming_grad(incoming: torch.Tensor) -> None:
                local.add_(incoming)  # our own copy; the gradient itself is only read
                return None

            self._adding[index] = param.register_hook(unserializable(self._guard(on_incoming_grad)))
        return local

    def drop(self) -> None:
        """Forget every sum and remove its hook (their memory goes back)."""
        for handle in self._adding.values():
            handle.remove()
        self._adding.clear()
        self.local.clear()
