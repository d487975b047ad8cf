"""What a collective call is, as the listeners see it: the collectives wrapped and, for each, the
tensors before and after the op; the call's site (the first frame outside torch and msmon); the
listener protocol. collective_listeners.py does the wrapping."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

Getter = Callable[[str], Any]
# op -> function of the bound-argument getter giving (tensors before the op, tensors after it)
Spec = Callable[[Getter], "tuple[Any, Any]"]


def _is_root(get: Getter, global_name: str, group_name: str) -> bool:
    """Whether this rank is the root (dst/src) of a rooted collective."""
    group = get("group")
    if get(group_name) is not None:
        return dist.get_rank(group) == get(group_name)
    root = get(global_name)
    return root is None or dist.get_rank() == root


def _p2p_ops(get: Getter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ops = get("p2p_op_list") or []
    sends = [op.tensor for op in ops if getattr(op.op, "__name__", "") == "isend"]
    return sends, [op.tensor for op in ops]


COLLECTIVES: dict[str, Spec] = {
    "all_reduce": lambda a: (a("tensor"), a("tensor")),
    # only the destination holds the result of a reduce; other ranks' buffers are scratch
    "reduce": lambda a: (a("tensor"), a("tensor") if _is_root(a, "dst", "group_dst") else None),
    "broadcast": lambda a: (a("tensor"), a("tensor")),
    "all_gather": lambda a: (a("tensor"), a("tensor_list")),
    "all_gather_into_tensor": lambda a: (a("input_tensor"), a("output_tensor")),
    "_all_gather_base": lambda a: (a("input_tensor"), a("output_tensor")),
    "reduce_scatter": lambda a: (a("input_list"), a("output")),
    "reduce_scatter_tensor": lambda a: (a("input"), a("output")),
    "_reduce_scatter_base": lambda a: (a("input"), a("output")),
    "all_to_all": lambda a: (a("input_tensor_list"), a("output_tensor_list")),
    "all_to_all_single": lambda a: (a("input"), a("output")),
    "gather": lambda a: (a("tensor"), a("gather_list")),
    "scatter": lambda a: (a("scatter_list"), a("tensor")),
    # a send's "after" is the data that went out, so it is seen without cc_pre_hook too
    "send": lambda a: (a("tensor"), a("tensor")),
    "recv": lambda a: (None, a("tensor")),
    "isend": lambda a: (a("tensor"), a("tensor")),
    "irecv": lambda a: (None, a("tensor")),
    "batch_isend_irecv": _p2p_ops,
}
ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument: a tensor, a list of tensors, or nothing."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


@dataclass(frozen=True)
class CallSite:
    """Where a collective was called from: the first frame outside torch and msmon."""

    path: str
    line: int
    function: str

    @functools.cached_property
    def short(self) -> str:
        """`train.py[23]`: how the site appears in metric names."""
        return f"{os.path.basename(self.path)}[{self.line}]"

    @functools.cached_property
    def full(self) -> str:
        """`/abs/path/train.py[23]`: what cc_codeline patterns are matched against."""
        return f"{self.path}[{self.line}]"


UNKNOWN_SITE = CallSite("<unknown>", 0, "<unknown>")


@dataclass
class CollectiveCall:
    """One call of a collective, as listeners see it."""

    op: str
    site: CallSite
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    group: Any
    async_op: bool
    extra: dict[int, Any] = field(default_factory=dict)  # listeners' own per-call state, keyed by id(listener)


class CollectiveListener(Protocol):
    def wants(self) -> bool:
        """Cheap: whether anything is to be seen now (else the call costs nothing more)."""

    def on_launch(self, call: CollectiveCall) -> bool:
        """Before the op runs; True asks for on_complete."""

    def on_complete(self, call: CollectiveCall) -> None:
        """The op's result is in call.outputs."""


# -- call sites -----------------------------------------------------------------------------------
def _skipped_dirs() -> tuple[str, ...]:
    msmon_dir = os.path.dirname(os.path.abspath(sys.modules["msmon"].__file__ or ""))
    return (os.path.dirname(torch.__file__) + os.sep, msmon_dir + os.sep)


_SKIPPED = _skipped_dirs()
_site_cache: dict[tuple[Any, int], CallSite] = {}


def find_call_site(frame: Any) -> CallSite:
    """Walk up from `frame` to the first frame outside torch and msmon; no stack capture."""
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return UNKNOWN_SITE
    key = (frame.f_code, frame.f_lineno)
    site = _site_cache.get(key)
    if site is None:
        code = frame.f_code
        site = _site_cache[key] = CallSite(code.co_filename, frame.f_lineno, code.co_name)
    return site
