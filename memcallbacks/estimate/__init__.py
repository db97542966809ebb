"""Theory: what params, grads and optimizer state should take per rank."""

from memcallbacks.estimate.compute import *  # noqa: F401,F403
from memcallbacks.estimate.compute import __all__  # noqa: F401
