"""Theory: what params, grads and optimizer state should take per rank (``docs/theory.md``)."""

from memcallbacks._base.units import GB, GiB
from memcallbacks.estimate.compare import compare, estimate_grid
from memcallbacks.estimate.compute import estimate
from memcallbacks.estimate.layers import find_layers
from memcallbacks.estimate.measure import estimate_for, measure_model_states
from memcallbacks.estimate.result import MemoryEstimate
from memcallbacks.estimate.tables import OPTIMIZERS, PRECISIONS, SHARDINGS, STRATEGIES

__all__ = [
    "GB",
    "GiB",
    "OPTIMIZERS",
    "PRECISIONS",
    "SHARDINGS",
    "STRATEGIES",
    "MemoryEstimate",
    "compare",
    "estimate",
    "estimate_for",
    "estimate_grid",
    "find_layers",
    "measure_model_states",
]
