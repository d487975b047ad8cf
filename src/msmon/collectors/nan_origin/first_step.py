"""What the non-finite origin costs, counted in the first recorded step and said once at start.

Any alert rule switches the origin on (`nan_origin` left unset), so a user who only asked for
alerts pays for it without having asked; the start line says so, with what one step of this
very model cost: the reductions it launched (one per tensor that no statistics row already
told), the flags a statistics row told for free, and the Python hook calls. It makes no host
sync: its flags reach the host in the step's one copy. benchmarks/nan_origin_cost.py counts
the same on the reference model and times it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OriginWork:
    """One step's work of the non-finite origin, counted as it happens."""

    reductions: int = 0  # tensors reduced (one kernel each) for their flag
    from_rows: int = 0  # flags told by a statistics row the activation collector took anyway
    module_hooks: int = 0  # forward pre- and post-hook calls
    gradients: int = 0  # gradients flagged in backward (tensor hooks that called back)

    def line(self, rank: int, step: int) -> str:
        free = f" ({self.from_rows} more flags read off statistics rows, at no cost)" if self.from_rows else ""
        return (
            f'msmon[rank {rank}]: the alert rules switch on the non-finite origin ("nan_origin": false '
            f"switches it off); in step {step} it launched {self.reductions} reductions, one kernel each{free}, "
            f"made {self.module_hooks} module hook calls, flagged {self.gradients} gradients in backward, and "
            "no host sync"
        )
