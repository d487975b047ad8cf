"""Attach msmon to the optimizer Megatron builds: `megatron.core.optimizer.get_megatron_optimizer
(config, model_chunks, ...)` and Megatron-LM's `setup_model_and_optimizer`, no code change.

The model chunks are the virtual-pipeline chunks, so names get their `{chunk}:` prefixes. Both
functions are wrapped as module attributes as soon as their modules are imported (before the
training code's `from ... import` binds them); torch optimizers built inside are left to this
instrumentor.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from ...seams.patching import Replacements
from ...system.distributed import current_rank
from .. import Session
from ..handover import attach, suppressed

logger = logging.getLogger("msmon")

TARGETS = (
    # module                       function                     where (model chunks, optimizer) are
    ("megatron.core.optimizer", "get_megatron_optimizer", "arguments"),
    ("megatron.training.training", "setup_model_and_optimizer", "result"),
)

_replaced = Replacements()
_session: Session | None = None


def instrument(session: Session) -> None:
    global _session
    import wrapt

    if _session is not None:
        return
    _session = session
    for module_name, function, where in TARGETS:
        wrapt.register_post_import_hook(_wrapper_installer(module_name, function, where), module_name)


def uninstrument() -> None:
    global _session
    _replaced.restore()
    _session = None  # post-import hooks registered with wrapt now do nothing


def _wrapper_installer(module_name: str, function: str, where: str) -> Callable[[Any], None]:
    def install(module: Any) -> None:
        session = _session
        if session is not None:
            _replaced.replace(module, function, lambda original: _wrap(session, original, function, where))

    return install


def _wrap(session: Session, original: Callable[..., Any], function: str, where: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not session.may_attach():
            return original(*args, **kwargs)
        with suppressed():
            result = original(*args, **kwargs)
        try:
            if where == "arguments":
                chunks = kwargs.get("model_chunks", args[1] if len(args) > 1 else None)
                optimizer = result
            else:
                chunks, optimizer = result[0], result[1]
            if chunks is not None and optimizer is not None:
                attach(session, list(chunks) if isinstance(chunks, (list, tuple)) else chunks, optimizer, function)
        except Exception as exc:  # monitoring must never break the training script
            logger.error(
                "msmon[rank %d]: attaching to the optimizer of %s failed; it is not monitored: %r",
                current_rank(),
                function,
                exc,
            )
        return result

    return wrapper
