"""Pre-flight inside the monitor: predict the first batch's step, warn, compare sampled steps with it.

The session owns one :class:`PreflightCheck`. Adapters hand it the first batch (Lightning, before
step 0 starts) or let it watch the model's first training forward (the plain-loop ``Monitor`` and
the adapters built on it); :func:`memcallbacks.preflight.predict` then runs the step on fake
tensors. Nothing here can stop training: a step that cannot run on fake tensors is one warning.

Measured and predicted peaks are compared in one frame per device:

- devices with an allocator (CUDA, other accelerators): absolute allocated bytes, as predicted;
- CPU, where peaks are resident-set high-water marks: the measured peak *above the RSS at step
  start* against the predicted peak *above the predicted step start* (params, optimizer state,
  the batch), since RSS also holds the interpreter and libraries.
"""


from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from memcallbacks._base.findings import Finding
from memcallbacks._base.columns import MICRO_BATCHES, OPTIMIZER_STEPS, PEAK_ALLOCATED, PEAK_BACKWARD, PEAK_FORWARD, PEAK_OPTIMIZER, RESERVED, STEP
from memcallbacks._base.units import GiB, format_bytes
from memcallbacks._runtime.lifecycle import weak_method
from memcallbacks._runtime.readout import predicted_columns

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks.preflight import BatchFit, Prediction

log = logging.getLogger(__name__)

__all__ = ["PreflightCheck", "MIN_GAP_BYTES", "PHASES", "autocast_precision", "fake_step_running", "fake_steps"]

from memcallbacks._base.columns import TRAINING_PHASES as PHASES
from memcallbacks._base.cpu import own_time
_PEAK_COLUMN = {"forward": PEAK_FORWARD, "backward": PEAK_BACKWARD, "optimizer": PEAK_OPTIMIZER}
MIN_GAP_BYTES = 8 << 20
"""A gap under this is never a finding: RSS moves by pages and thread stacks, the CUDA allocator by blocks."""

_NAN = math.nan
_running = 0  # fake steps in progress in this process: their optimizer steps fire torch's global hooks too


def fake_step_running() -> bool:
    """True while a pre-flight runs fake steps: global optimizer hooks must ignore what they see."""
    return _running > 0


@contextlib.contextmanager
def fake_steps() -> Iterator[None]:
    """Around fake steps run outside :class:`PreflightCheck` (an OOM's remedies): the hooks ignore them too."""
    global _running
    _running += 1
    try:
        yield
    finally:
        _running -= 1


def _hopper(device: torch.device) -> bool:
    """Compute capability 9 or newer keeps a 32 MiB cuBLAS workspace (the allocator model's ``hopper``)."""
    if device.type != "cuda":
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] >= 9
    except Exception:
        return False


class PreflightCheck:
    """One fit's pre-flight: the prediction, the capacity check and the running comparison."""

    def __init__(self, config: Any, engine: Any, owner: str, log: logging.Logger, report: Callable[[Finding], None],
                 current_step: Callable[[], int]) -> None:
        """``engine``: the session's :class:`MemoryEngine`; ``report``: where findings go (the
        session's finding log); ``current_step``: the open step, for the findings' step."""
        self.config = config
        self.engine = engine
        self.owner = owner
        self.log = log
        self.report_finding = report
        self.current_step = current_step
        self._handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self.release()
        self.prediction: Prediction | None = None
        self.start_bytes = 0  # the prediction's step start and phase peaks, as this framework orders the step
        self.peaks: dict[str, int] = {}
        self.status = "waiting" if self.config.preflight else "off"
        self.info: dict[str, Any] = {}
        self.precision: str | None = None
        self.strategy: str | None = None
        self.world_size: int | None = None
        self.steps_compared = 0
        self.measured_max: dict[str, float] = {}
        self.gap_max: dict[str, float] = {}

    def release(self) -> None:
        """Drop the model references and the first-forward hooks (safe to call twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.model: Any = None
        self.optimizer: Any = None

    def set_objects(self, model: Any, optimizer: Any, *, precision: str | None = None, strategy: str | None = None, world_size: int | None = None) -> None:
        """The run's model, optimizer, precision and strategy, as the theory check gets them."""
        if self.status != "waiting":
            return
        self.model, self.optimizer = model, optimizer
        self.precision, self.strategy, self.world_size = precision, strategy, world_size

    @property
    def due(self) -> bool:
        """Pre-flight is on and has not run yet in this fit."""
        return self.status == "waiting" and self.engine.enabled

    @property
    def relative(self) -> bool:
        """CPU: compare peaks above the step start (RSS), not absolute bytes."""
        return self.engine.device_info.get("kind", "cpu") == "cpu"

    # ------------------------------------------------------------------ running the prediction
    def watch_first_forward(self, model: torch.nn.Module) -> None:
        """Plain loops: predict at ``model``'s first training forward, from the arguments it is called with."""
        if self.status == "waiting":
            self._handles.append(model.register_forward_pre_hook(weak_method(self._first_forward), prepend=True, with_kwargs=True))

    def _first_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not (self.due and module.training and torch.is_grad_enabled()):
            return
        device = self.engine.device
        precision = self.precision or autocast_precision(device.type if device is not None else "cpu")
        from memcallbacks.preflight._step import call_step

        self.run((tuple(args), dict(kwargs)), model=module, forward_fn=call_step, precision=precision)

    def run(
        self, batch: Any, *, model: Any = None, forward_fn: Callable[..., Any] | None = None, precision: str | None = None,
        skip: str | None = None, grads_through_forward: bool = False,
    ) -> None:
        """Predict the step of ``batch`` once per fit; warn when it exceeds capacity. Never raises.

        ``grads_through_forward``: the framework frees the previous step's gradients after forward,
        not before the step (Lightning's automatic optimization calls ``zero_grad`` between
        ``training_step`` and backward), so they are alive at step start and through forward."""
        if not self.due:
            return
        engine = self.engine
        t0 = own_time()
        try:
            if skip:
                self.status = "skipped"
                self.info["reason"] = skip
                self._warn("%s: pre-flight skipped: %s. Training goes on without a prediction.", self.owner, skip)
                return
            self.status = "running"
            self._predict(model if model is not None else self.model, batch, forward_fn, precision or self.precision, grads_through_forward)
        except Exception as exc:
            self._failed(exc)
        finally:
            seconds = own_time() - t0
            self.info["seconds"] = round(seconds, 3)
            if engine.sampling:
                engine.add_own_time(seconds)
            self.release()

    def _predict_kwargs(self, forward_fn: Callable[..., Any] | None, precision: str | None) -> dict[str, Any]:
        device = self.engine.device or torch.device("cpu")
        return dict(
            forward_fn=forward_fn,
            precision=precision or "fp32",
            device=device,
            strategy=self.strategy or "single",
            world_size=self.world_size or 1,
            hopper=_hopper(device),
        )

    def _predict(self, model: Any, batch: Any, forward_fn: Callable[..., Any] | None, precision: str | None, grads_kept: bool) -> None:
        global _running
        _running += 1
        try:
            self._predict_and_check(model, batch, forward_fn, precision, grads_kept)
        finally:
            _running -= 1

    def _adopt(self, p: "Prediction", grads_kept: bool) -> int:
        """Keep ``p`` and its step as the framework orders it; returns the gradient bytes alive at step start."""
        grads = int(p.breakdown.get("optimizer", {}).get("grads", 0)) if grads_kept else 0
        self.prediction, self.status = p, "predicted"
        self.start_bytes = p.start_bytes + grads
        self.peaks = dict(p.phase_peaks())
        self.peaks["forward"] += grads
        return grads

    def _predict_and_check(self, model: Any, batch: Any, forward_fn: Callable[..., Any] | None, precision: str | None, grads_kept: bool) -> None:
        from memcallbacks.preflight import max_batch_size, predict
        from memcallbacks.preflight.batch_size import batch_size_of, resize_batch

        if model is None:
            raise ValueError("no model to predict; give the monitor the model (Monitor(model, optimizer))")
        kwargs = self._predict_kwargs(forward_fn, precision)
        p = predict(model, batch, self.optimizer, **kwargs)
        grads = self._adopt(p, grads_kept)
        engine = self.engine
        capacity = self.config.capacity_bytes or engine.capacity
        source = "capacity_bytes" if self.config.capacity_bytes else ("host RAM" if engine.device_info.get("kind") == "cpu" else "device capacity")
        size = batch_size_of(batch)
        self.info.update(
            batch_size=size,
            capacity_bytes=capacity,
            capacity_source=source,
            precision=kwargs["precision"],
            optimizer=type(self.optimizer).__name__ if self.optimizer is not None else None,
            frame="above_step_start" if self.relative else "allocated",
            tolerance=self.config.preflight_tolerance,
            prediction=p.to_dict(),
            grads_alive_at_step_start_bytes=grads,
            peaks=dict(self.peaks),
        )
        if self.optimizer is None:
            self.info["note"] = "no optimizer known to the monitor: the prediction has no optimizer step or state"
        phase = max(self.peaks, key=lambda ph: self.peaks[ph])
        peak, first = self.peaks[phase], False
        if p.first_step is not None and p.first_step.peak_bytes > peak:
            phase, peak, first = p.first_step.peak_phase, p.first_step.peak_bytes, True
        self.info["fits"] = not capacity or peak <= capacity
        if self.info["fits"]:
            return
        fit = None
        if size is not None and size > 1 and capacity > grads:
            # the gradients kept through forward do not grow with the batch
            fit = max_batch_size(model, lambda n: resize_batch(batch, size, n), capacity - grads, self.optimizer, low=1, high=size - 1, **kwargs)
            self.info["max_batch_size"] = {"batch_size": fit.batch_size, "peak_bytes": fit.peak_bytes + grads, "tried": dict(fit.tried)}
        at_peak = dict((p.first_step if first else p).breakdown.get(phase, {}))
        if phase == "forward" and not first:
            at_peak["grads"] = at_peak.get("grads", 0) + grads  # the previous step's, kept through forward
        finding = self._over_capacity(p, phase, peak, at_peak, first, capacity, source, size, fit, grads)
        remedies = self._remedies(model, batch, p, kwargs, capacity, source, fit.predictions if fit is not None else {})
        if remedies:
            self.info["explanation"] = remedies.to_dict()
            finding.details["remedies"] = self.info["explanation"]["remedies"]
            finding.message += " What makes it fit, largest predicted saving first: " + "; ".join(
                f"{i}. {r}" for i, r in enumerate(remedies.remedies[:3], 1))
        self.report_finding(finding)

    def _remedies(self, model: Any, batch: Any, p: "Prediction", kwargs: dict[str, Any], capacity: int, source: str,
                  known: dict[int, Any]) -> Any:
        """The explanation an out-of-memory error at this step would get (``memcallbacks.oom``), with each
        change's predicted saving; None when it cannot be made (it is said in the log)."""
        from memcallbacks.oom import StepModel, explain_prediction

        extra = {k: kwargs[k] for k in ("strategy", "world_size", "hopper")}
        step = StepModel(model, batch, self.optimizer, kwargs["precision"], kwargs["device"], kwargs["forward_fn"] or "default", extra,
                         dict(known))
        try:
            return explain_prediction(step, p, capacity, source)
        except Exception as exc:  # the finding stands without its ranked changes
            self._warn("%s: pre-flight could not rank the changes that make the step fit: %s", self.owner, exc)
            return None

    def _over_capacity(
        self, p: "Prediction", phase: str, peak: int, at_peak: dict[str, int], first: bool, capacity: int, source: str, size: int | None,
        fit: "BatchFit | None", grads: int,
    ) -> Finding:
        biggest = sorted(((k, v) for k, v in at_peak.items() if v > 0), key=lambda kv: kv[1], reverse=True)[:3]
        holders = ", ".join(f"{name} ({format_bytes(b)})" for name, b in biggest)
        modules = ", ".join(f"{name} ({format_bytes(b)})" for name, b in p.top_modules[:3])
        if fit is None:
            sizing = f"The batch size could not be searched (batch size {size}, dimension 0 of the batch's first tensor)."
        elif fit.batch_size == 0:
            sizing = f"No batch size fits: batch size 1 is predicted to peak at {format_bytes(fit.peak_bytes + grads)}."
        else:
            sizing = (f"The largest batch size that fits is {fit.batch_size} (predicted peak {format_bytes(fit.peak_bytes + grads)}); "
                      f"this batch has {size} (dimension 0 of its first tensor).")
        which = "the first step" if first else "each step"
        message = (
            f"pre-flight: {which} is predicted to peak at {format_bytes(peak)} in {phase}, above the "
            f"{format_bytes(capacity)} of {source}, so it would likely run out of memory. At that peak: {holders}"
            + (f"; top modules by activations: {modules}" if modules else "")
            + f". {sizing} Fix: a smaller batch, activation checkpointing, a lower precision or sharding."
        )
        details = {"phase": phase, "predicted_peak_bytes": peak, "capacity_bytes": capacity, "batch_size": size,
                   "max_batch_size": fit.batch_size if fit is not None else None}
        return Finding(kind="preflight", key="preflight:capacity", step=int(self.current_step()), message=message,
                       bytes=int(peak - capacity), details=details)

    def _failed(self, exc: Exception) -> None:
        from memcallbacks.preflight import PreflightError

        self.status = "failed"
        self.prediction = None
        self.info.update(error=f"{type(exc).__name__}: {exc}", op=getattr(exc, "op", None))
        expected = isinstance(exc, (PreflightError, ValueError, NotImplementedError))
        self._warn("%s: pre-flight could not predict this run's step (%s: %s). Training goes on without a prediction.",
                   self.owner, type(exc).__name__, exc, exc_info=None if expected else exc)

    def _warn(self, message: str, *args: Any, exc_info: BaseException | None = None) -> None:
        if self.engine.rank == 0:
            self.log.warning(message, *args, exc_info=exc_info)

    # ------------------------------------------------------------------ comparing with measured steps
    def levels(self, row: list[Any]) -> dict[str, float] | None:
        """Each phase's predicted peak in the frame of ``row``'s measured peaks (None without a prediction)."""
        if self.prediction is None:
            return None
        if self.relative:
            base = float(row[RESERVED])
            return {ph: base + self.peaks[ph] - self.start_bytes for ph in PHASES}
        return {ph: float(self.peaks[ph]) for ph in PHASES}

    def compare(self, row: list[Any]) -> None:
        """A sampled steady-state step (one micro-batch, after an optimizer step): measured vs predicted per phase."""
        levels = self.levels(row)
        engine = self.engine
        if levels is None or row[MICRO_BATCHES] != 1 or engine.optimizer_steps_total - row[OPTIMIZER_STEPS] <= 0:
            return
        base = float(row[RESERVED]) if self.relative else 0.0
        worst: tuple[str, float, float, float] | None = None
        for ph in PHASES:
            measured = row[_PEAK_COLUMN[ph]]
            if measured != measured:  # NaN: the phase was not seen
                continue
            amount, predicted, gap = measured - base, levels[ph] - base, measured - levels[ph]
            self.measured_max[ph] = max(self.measured_max.get(ph, -math.inf), amount)
            self.gap_max[ph] = max(self.gap_max.get(ph, -math.inf), gap)
            if gap > self.config.preflight_tolerance * max(predicted, 0.0) + MIN_GAP_BYTES and (worst is None or gap > worst[1]):
                worst = (ph, gap, amount, predicted)
        self.steps_compared += 1
        if worst is not None:
            self.report_finding(self._above(int(row[STEP]), *worst))

    def _above(self, step: int, phase: str, gap: float, amount: float, predicted: float) -> Finding:
        frame = "above the RSS at step start" if self.relative else "allocated"
        message = (
            f"the {phase} peak was {format_bytes(amount)} ({frame}) but pre-flight predicted {format_bytes(predicted)}: "
            f"{format_bytes(gap)} more than the fake step saw (tolerance {self.config.preflight_tolerance:.0%} + "
            f"{format_bytes(MIN_GAP_BYTES)}). The fake step cannot see memory outside torch tensors (NumPy, a kernel's "
            "own workspace), code that allocates only after the first steps, or tensors kept from an earlier step. "
            "Fix: snapshot this step (auto_snapshot=True) and compare its largest allocations with the prediction's "
            "breakdown (report.json, \"preflight\")."
        )
        details = {"phase": phase, "measured_bytes": int(amount), "predicted_bytes": int(predicted), "gap_bytes": int(gap),
                   "frame": "above_step_start" if self.relative else "allocated"}
        return Finding(kind="preflight", key="preflight:measured", step=step, message=message, bytes=int(gap), details=details)

    # ------------------------------------------------------------------ outputs
    def metrics(self, row: list[Any] | None) -> dict[str, float]:
        """Logged keys (the same on every logged step and rank; NaN, hence not logged, without a prediction)."""
        if not self.config.preflight:
            return {}
        pfx = self.config.prefix
        levels = self.levels(row) if row is not None else None
        out = {f"{pfx}/predicted_peak_{ph}_GiB": levels[ph] / GiB if levels else _NAN for ph in PHASES}
        top = max(levels.values()) if levels else _NAN
        out[f"{pfx}/predicted_peak_GiB"] = top / GiB
        out[f"{pfx}/preflight_error_GiB"] = (row[PEAK_ALLOCATED] - top) / GiB if levels and row is not None else _NAN
        return out

    def add_columns(self, frame: Any) -> Any:
        """``predicted_peak_{forward,backward,optimizer}`` (in the measured peaks' frame) and
        ``predicted_peak_error`` (measured step peak minus the predicted one), when there is a prediction."""
        return predicted_columns(frame, self.column_spec())

    def column_spec(self) -> dict[str, Any] | None:
        """What :meth:`add_columns` adds, as plain data (the writer process adds them to its frame): None without a prediction."""
        if self.prediction is None:
            return None
        return {"relative": bool(self.relative), "start": self.start_bytes if self.relative else 0,
                "peaks": {ph: self.peaks[ph] for ph in PHASES}}

    def report(self) -> dict[str, Any] | None:
        """``report.json``'s ``"preflight"``: status, the prediction, capacity, and measured vs predicted per phase."""
        if not self.config.preflight:
            return None
        out: dict[str, Any] = {"status": self.status, **self.info}
        if self.prediction is not None:
            start = self.start_bytes if self.relative else 0
            phases = {}
            for ph, peak in self.peaks.items():
                predicted = peak - start
                measured = self.measured_max.get(ph)
                phases[ph] = {
                    "predicted_bytes": int(predicted),
                    "measured_max_bytes": int(measured) if measured is not None else None,
                    "max_gap_bytes": int(self.gap_max[ph]) if ph in self.gap_max else None,
                    "ratio": round(measured / predicted, 4) if measured is not None and predicted > 0 else None,
                }
            out["comparison"] = {"steps_compared": self.steps_compared, "phases": phases}
        return out


def autocast_precision(device_type: str) -> str | None:
    """``"bf16-mixed"``/``"16-mixed"`` when the caller runs under autocast on ``device_type`` now."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(dtype)
