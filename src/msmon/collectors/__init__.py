"""One collector per kind of tensor. Collectors record rows into the step buffer; they know
nothing about files."""

from .activations import ActivationCollector, MicroStepTracker
from .base import Collector, MonitoredParam
from .grads import GradCollector
from .optimizer_state import OptimizerStateCollector
from .params import ParamCollector
from .structure import StructCollector

__all__ = [
    "Collector",
    "MonitoredParam",
    "ActivationCollector",
    "MicroStepTracker",
    "GradCollector",
    "OptimizerStateCollector",
    "ParamCollector",
    "StructCollector",
]
