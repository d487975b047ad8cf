"""What a framework package declares: one typed `Framework`, exported by its light
`hooks/<name>/__init__.py` as `FRAMEWORK`. The registry (seams/registry.py) finds the
folders itself, so the spec is all a new framework writes; and the layers that ask about frameworks (adapter
choice, parallel groups, the pipeline stage, the replica check) read typed fields instead of
probing modules for optional names.

Every callable here is light to hold: a package's `__init__.py` never imports its library, so
each field that needs the library imports it when called."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .adapters import OptimizerAdapter
    from .backward_calls import LossScaling
    from .parallel_groups import ParallelGroups

# `precedence` of the framework packages (lower is asked first; ties go by name). The most
# specific first: torch_optim, whose adapter fits any optimizer, after every framework built on
# torch.optim; gaps leave room for a new framework between two others.
#
#   precedence  package             switched_on_by
#   10          megatron            megatron.core
#   20          deepspeed           deepspeed
#   30          fsdp                torch.distributed.fsdp
#   90          torch_optim         torch
#   100         torch_distributed   torch

Position = tuple[int, list[int]]  # (pipeline stage, global ranks of the pipeline group)
ReplicaRule = Callable[[Any], "str | None"]  # why a parameter is not a replica, None when it is
# the reason every framework with expert parallelism gives (DeepSpeed and Megatron mark them alike)
EXPERT_PARAMETER = "an expert parameter (allreduce=False): replicated over its expert-data-parallel group only"
# (models, optimizer, before, after) -> the undo, or None (Framework.whole_gradient_reduction)
WholeReduction = Callable[
    [list[Any], Any, Callable[["list[Any] | None"], None], Callable[[], None]], "Callable[[], None] | None"
]


@dataclass(frozen=True)
class Framework:
    """One instrumented library, as msmon knows it. The optional fields are None (or empty)
    where the library has no such thing."""

    #: the package's folder in hooks/ (also the registry's key)
    name: str
    #: the module whose import switches the package on (right away when already imported)
    switched_on_by: str
    #: its place in the order frameworks are asked, lower first (the table above)
    precedence: int
    #: the distribution whose installed version is checked when the package switches on
    distribution: str
    #: the versions msmon was built and tested against (">=0.17,<0.20"): outside, one warning
    supported: str
    #: switch msmon on for this library (the opentelemetry shape; what it returns is not read),
    #: and off again; given the instrumentors' Session (hooks/, the layer above: typed Any here)
    instrument: Callable[[Any], object]
    uninstrument: Callable[[], None]
    #: the adapter of its optimizer classes, None for an optimizer that is not its own
    adapter_for: Callable[[Any], OptimizerAdapter | None] | None = None
    #: names of its optimizer classes that drive an inner torch optimizer through `.optimizer`
    #: (monitored as they are, not wrappers to see through)
    optimizer_classes: frozenset[str] = frozenset()
    #: msprobe's opt_ty names -> the adapter class names that fit them
    opt_ty: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: fill the data-, tensor- and pipeline-parallel groups from the models handed over
    groups_of_models: Callable[[ParallelGroups, list[Any], Any], None] | None = None
    #: fill them from the process's parallel state
    groups_of_process: Callable[[ParallelGroups], None] | None = None
    #: this rank's pipeline stage and group, where the library set one up
    pipeline_position: Callable[[], Position | None] | None = None
    #: the replica check's exceptions for (models, optimizer, weights), None when none apply
    replica_exclusion: Callable[[list[Any], Any, bool], ReplicaRule | None] | None = None
    #: the loss scalers it provides (seams/backward_calls.py), asked once its library is imported
    loss_scaling: Callable[[], LossScaling] | None = None
    #: where the library itself reduces whole gradients in place of a torch DDP module, so that each
    #: rank then holds the whole reduced gradient: given (models, optimizer, before, after), calls
    #: `before(pairs)` right before it reduces these (parameter, rank-local gradient) pairs in
    #: place (None: every parameter's `grad_of`), `after()` once the whole reduction is done (the
    #: reduced gradients are then `grad_of` the parameters), and returns the undo; None where
    #: these models and optimizer reduce otherwise (grad_agreement)
    whole_gradient_reduction: WholeReduction | None = None
