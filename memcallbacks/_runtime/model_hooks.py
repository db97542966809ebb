"""The plain loop's model hooks: forward hooks on only while needed, outputs kept, backward marked.

Every hook registered here is a :class:`~memcallbacks._runtime.lifecycle.WeakHook` (lifecycle.py:
pickled and copied models reference that class), made anew for each registration; the monitor
owns its :class:`ModelHooks`, which holds the monitor's own pre-hook weakly, so a monitor dropped
without ``close()`` is still freed at once and its hooks go inert.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from memcallbacks._base.columns import BACKWARD, FORWARD
from memcallbacks._runtime.guard import Guarded, entry_point
from memcallbacks._runtime.lifecycle import GatedHook, weak_method

if TYPE_CHECKING:  # pragma: no cover
    from memcallbacks._runtime.schedule import HookMeter
    from memcallbacks._runtime.session import Session

__all__ = ["ModelHooks", "first_grad_tensors", "remove_all"]


class ModelHooks(Guarded):
    """The plain loop's hooks on its models, on only while they do something: the monitor's forward
    pre-hook (``pre``, a bound method: it opens steps in auto mode), and the forward hook, the
    output tensors' hook and the backward-end callback here, which keep the step's output graph
    tensors (leak detection) and, on sampled steps, mark where backward begins and ends.

    Always on in auto mode; under track()/step() only on steps that use them (sampled, or with
    lingering marks to check), since any module hook sends every forward through torch's slower
    hooked call path."""

    def __init__(self, session: Session, pre: Callable[..., Any], meter: HookMeter | None = None) -> None:
        self._session = session  # the guard (entry_point) hands a fault to it
        self._pre = weakref.WeakMethod(pre)
        self.meter = meter  # times each open hook call whole (HookMeter)
        self.gates: list[tuple[GatedHook, GatedHook]] = []  # (pre-hook, forward hook) per hooked model
        self.models: list[nn.Module] = []
        self.handles: list[Any] = []  # the cleanup holds this very list (it is emptied, never replaced)
        self.on = True
        self.evaluating = False  # inside Monitor.evaluate(): a forward is an evaluation batch
        self.backward_open = False
        # auto mode with no optimizer known: a backward ending the step is what lets the next forward open the
        # next one (the output-tensor hook on every step then, not only on sampled ones), not each forward:
        # a policy called once per environment step is one step per episode
        self.awaiting_backward = False
        self.backward_seen = False  # a backward reached this step's outputs (awaiting_backward)
        self.output: Any = None  # a graph tensor of this step's forward, held until the step ends
        self.outputs: list[torch.Tensor] = []  # the tensors of this step's forward outputs (leak detection)
        self._weak_backward_start = weak_method(self._backward_start)

    def add(self, model: nn.Module) -> None:
        """Watch ``model``'s forward passes (its hooks are installed now unless they are off)."""
        self.models.append(model)
        if self.on:
            self._register(model)

    def _register(self, model: nn.Module) -> None:
        pre = self._pre()
        if pre is None:  # pragma: no cover - the monitor is gone
            return
        gates = (GatedHook(pre, self.meter), GatedHook(self._forward_post, self.meter))
        self.gates.append(gates)
        self.handles.append(model.register_forward_pre_hook(gates[0]))
        self.handles.append(model.register_forward_hook(gates[1]))

    # ------------------------------------------------------------------ gates (see GatedHook)
    def open_gates(self) -> None:
        """Every hook calls through again: a step ended or may end, evaluation began, an optimizer stepped."""
        for pre, post in self.gates:
            pre.open = post.open = True

    def settle(self, auto_step_begun: bool, awaiting_backward: bool = False) -> None:
        """After a step began: the forward hook only where the step keeps its outputs (sampled, or
        marked for the lingering check); the pre-hook closed for the rest of an automatic step that
        an optimizer step ends (``auto_step_begun``: its later forwards only check that no optimizer
        stepped, and the optimizer hook reopens it) unless evaluation or a deferred lingering check needs it.
        ``awaiting_backward``: an automatic step with no optimizer known, which its backward ends (the
        forward hook then on every step, to see the backward reach the outputs: :attr:`backward_seen`)."""
        self.awaiting_backward = awaiting_backward
        self.backward_seen = False
        session = self._session
        post = session.step_open and (session.detailed_step or session.lingering_due or self.awaiting_backward)  # a deferred check may mark it
        pre = not (auto_step_begun and session.step_open and not session.lingering_due and not self.evaluating)
        for gate_pre, gate_post in self.gates:
            gate_pre.open, gate_post.open = pre, post

    def set(self, on: bool) -> None:
        """Install or remove the models' forward hooks (a few µs, only when the need changes)."""
        if on == self.on:
            return
        self.on = on
        if on:
            for model in self.models:
                self._register(model)
        else:
            remove_all(self.handles)
            self.gates.clear()

    def explicit_step(self) -> None:
        """track()/step() opened a step: the hooks on only where they do something (sampled steps,
        the first steps, a step whose start checks the previous step's marks)."""
        session = self._session
        self.set(session.detailed_step or session.lingering_pending)

    def evaluation(self, on: bool, was_on: bool = True) -> bool:
        """Enter (``on``) or leave ``Monitor.evaluate()``: inside, the hooks are on and a forward is one
        evaluation batch; leaving restores ``was_on``. Returns whether the hooks were on."""
        before = self.on
        self.evaluating = on and bool(self.models)
        self.set(True if on else was_on)
        self.open_gates()
        return before

    def release(self) -> None:
        """``close()``: the hooks off and the models forgotten."""
        self.set(False)
        self.models = []

    # ------------------------------------------------------------------ hooks (never raise)
    @entry_point("forward hook")
    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        session = self._session
        if self.evaluating or not session.step_open or not session.enabled or not torch.is_grad_enabled():
            return
        detailed = session.detailed_step
        if not (detailed or self.awaiting_backward):
            return
        try:
            tensors = first_grad_tensors(output)
            if detailed:
                if tensors and self.output is None:
                    self.output = tensors[0]  # its graph is what a kept loss would keep alive
                if len(self.outputs) < 8:
                    self.outputs.extend(tensors[: 8 - len(self.outputs)])  # a kept `logits` is watched
            if session.sampling or self.awaiting_backward:  # the backward's boundaries, or that it ran (awaiting_backward)
                for tensor in tensors:
                    tensor.register_hook(self._weak_backward_start)  # weak: a kept output must not keep the monitor
        except Exception as exc:
            session.fail(exc, "forward hook")

    @entry_point("backward hook")
    def _backward_start(self, grad: torch.Tensor) -> None:
        # fires once per output tensor; only the first one of a backward pass is a boundary
        if self.backward_open or not self._session.step_open:
            return
        self.backward_open = self.backward_seen = True
        self._session.boundary(FORWARD)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        except Exception as exc:  # pragma: no cover - private API moved
            self._session.fail(exc, "backward hook")

    @entry_point("backward-end callback")
    def _backward_end(self) -> None:
        self.backward_open = False
        self._session.boundary(BACKWARD)


def first_grad_tensors(output: Any, limit: int = 8) -> list[torch.Tensor]:
    """Tensors with a grad_fn in a model's output (tensor, tuple/list, dict, HF ModelOutput), bounded."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack and len(found) < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def remove_all(handles: list[Any]) -> None:
    """Remove hook handles, emptying the same list (the cleanup holds it)."""
    for handle in handles:
        handle.remove()
    handles.clear()
