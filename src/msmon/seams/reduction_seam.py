"""What a framework's whole-gradient-reduction seam (Framework.whole_gradient_reduction:
DeepSpeed's stage 0, FSDP1 NO_SHARD) does when it meets a layout it cannot read: grad_agreement
stops following that reduction, said once with the rank, and training goes on."""

from __future__ import annotations

import logging
from typing import Any

from ..system.distributed import current_rank

logger = logging.getLogger("msmon")


def stop_following(state: dict[str, Any], cannot: str, exc: BaseException) -> None:
    """Mark the seam's `state` failed (its hooks then do nothing) and say why, once."""
    state["failed"] = True
    logger.warning(
        "msmon[rank %d]: cannot %s (%r); grad_agreement is not recorded from now on (said once)",
        current_rank(),
        cannot,
        exc,
    )
