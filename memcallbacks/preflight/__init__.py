"""Pre-flight: predict a training step's memory per phase on fake tensors, before it runs.

``predict(model, batch, optimizer)`` runs two training steps of a structural copy of the model on
``FakeTensorMode`` tensors (right shapes and dtypes, no memory, nothing computed), follows every
storage from allocation to free, and reports the steady-state step's forward, backward and
optimizer peaks, what is alive at each peak and which modules hold the activations.
``max_batch_size`` searches the largest batch that fits a capacity; ``measure_step`` is the CPU
ground truth the predictions are checked against. See docs/preflight.md.
"""

from memcallbacks.preflight._step import PreflightError
from memcallbacks.preflight.batch_size import BatchFit, max_batch_size
from memcallbacks.preflight.measure import measure_step
from memcallbacks.preflight.predict import predict
from memcallbacks.preflight.prediction import Prediction

__all__ = ["BatchFit", "PreflightError", "Prediction", "max_batch_size", "measure_step", "predict"]
