"""One collector per feature: a file, or a folder where a feature has several jobs
(replica_check/, l2_features/, nan_origin/, trackers/). Collectors record rows into the step buffer and
write a side file only through output.artifacts; they know nothing about TrainerMon (they see
its StepContext only).

Importing a collector's module registers it (collectors.registry); every one is imported here.
"""

from . import comm, stack_info  # noqa: F401  (registration)
from .activations import ActivationCollector, MicroStepTracker
from .base import Collector, MonitoredParam
from .grads.collector import GradCollector
from .grads.sync import SyncGradCollector
from .l2_features.collector import L2FeatureCollector
from .loss import LossCollector
from .nan_origin.collector import NanOriginCollector
from .optimizer_state import OptimizerStateCollector
from .params import ParamCollector
from .rank_outlier import collector as rank_outlier_collector  # noqa: F401  (registration)
from .replica_check import collector as replica_check_collector  # noqa: F401  (registration)
from .structure import StructCollector
from .trackers import collector as trackers_collector  # noqa: F401  (registration)

__all__ = [
    "Collector",
    "MonitoredParam",
    "ActivationCollector",
    "MicroStepTracker",
    "GradCollector",
    "L2FeatureCollector",
    "LossCollector",
    "NanOriginCollector",
    "OptimizerStateCollector",
    "ParamCollector",
    "StructCollector",
    "SyncGradCollector",
]
