"""Pre-flight: predict a training step's memory per phase (activations included) on fake tensors, before it runs."""

from memcallbacks.preflight._step import PreflightError
from memcallbacks.preflight.predict import predict
from memcallbacks.preflight.prediction import Prediction

__all__ = ["PreflightError", "Prediction", "predict"]
