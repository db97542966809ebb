"""Own time no step timer sees: hook calls, torch's dispatch of them, the imports the monitor starts.

:class:`HookMeter` books what a hook call costs beyond the timers inside it (``hooks``), and counts
the calls torch makes through the monitor's gates, which :func:`hooked_call_cost_s` prices (the
``dispatch`` estimate); the imports a memcallbacks function starts during a run are timed apart
(:class:`ImportWatch`; the own clock in ``cpu.py`` leaves them out, and the step schedule books them
as ``imports``)."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from typing import Any, Callable

import torch

from memcallbacks._base.cpu import CLOCK_READS, IMPORT_S, IMPORTS

__all__ = ["HookMeter", "HOOK_CAP_S", "HOOK_FRAMES_S", "ImportWatch", "watch_imports", "unwatch_imports", "import_seconds",
           "imported_names", "hooked_call_cost_s"]

# A hook call's wall time counts up to this much: more is a time slice the machine gave another process.
HOOK_CAP_S = 300e-6
# What a hook call's frames cost around the work its timers measure, until quiet calls have measured it.
HOOK_FRAMES_S = 5e-6
_wall = time.perf_counter  # the hooks' clock: no system call

_thread_time = time.thread_time
_ident = threading.get_ident

# ---------------------------------------------------------------------- the hooks
class HookMeter:
    """The hooks' part of the own time: what a hook call costs beyond the step's own timers inside it
    (the call's frames, the guard, its checks). A call in which no timer ran (a quiet step's: most
    calls of a long run) is timed whole on the wall clock, at most :data:`HOOK_CAP_S` (more is a time
    slice the machine gave another process); the CPU clock the timers read is a system call, and one
    between two training steps slows the next by several µs (docs/benchmarks.md), more than such a
    call costs. A call in which timers ran (a busy step's) adds the frames a quiet call costs (a
    running mean, :attr:`frames_s`): its work is in the timers' parts.

    It also counts the calls torch makes through the monitor's gates on a module (``calls``, counted
    by ``GatedHook``), open or closed: each goes through torch's hooked call path, whose cost the
    schedule books as ``dispatch`` at :attr:`call_cost_s` a call (measured once per process; the
    schedule doubles it, as every cost the budget counts). ``schedule``: the step schedule
    (``_runtime/schedule.py``), which lists its meters and books what they charge."""

    __slots__ = ("schedule", "calls", "call_cost_s", "frames_s")

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        self.calls = 0
        self.call_cost_s = hooked_call_cost_s()
        self.frames_s = HOOK_FRAMES_S
        schedule.meters.append(self)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reads = CLOCK_READS[0]
        t0 = _wall()
        try:
            return fn(*args, **kwargs)
        finally:
            self.book(t0, reads)

    def book(self, t0: float, reads: int) -> None:
        """Charge the work begun at ``t0`` (``_wall()``), when ``CLOCK_READS[0]`` was ``reads``: :meth:`call`'s,
        or inline work timed the same way (track()'s quiet steps, which take no call through the meter)."""
        spent = _wall() - t0
        if CLOCK_READS[0] == reads:  # nothing inside was timed: the call's wall time is the hooks'
            spent = spent if spent < HOOK_CAP_S else HOOK_CAP_S
            self.frames_s += (spent - self.frames_s) * 0.0625
        else:
            spent = self.frames_s
        self.schedule.charge_hooks(spent)


# ---------------------------------------------------------------------- the imports it starts
# A module the monitor's code imports after the run has started costs the user's clock like any of its
# work, and can cost far more than a step (pandas: ~0.3 s). A meta path finder that finds nothing itself
# times the imports a memcallbacks function starts (its frame on the importing thread's stack; a module's
# own top-level imports, when the user imports memcallbacks, are not the run's), and own_time() leaves
# them out, so the schedule books them as their own part ("imports") rather than inside whatever part
# happened to import. Only modules not imported yet reach a finder: a running loop pays nothing for it.

_import_names: list[str] = []  # the first few of them, for the report
_import_state = {"depth": 0, "finding": False, "watchers": 0}
MAX_IMPORT_NAMES = 16


def _started_by_monitor(frame: Any) -> bool:
    """A memcallbacks function (not a module body) is on the stack from ``frame`` up."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("memcallbacks.") and frame.f_code.co_name != "<module>" and name != __name__:
            return True
        frame = frame.f_back
    return False


class _TimedLoader:
    """Stands in for a module's loader while it loads: times the outermost load on the own clock,
    then puts the real loader back in the module and its spec (nothing of it stays)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # a module that reads its loader while it loads sees the real one's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._timed(self.loader.create_module, spec)

    def exec_module(self, module: Any) -> None:
        try:
            self._timed(self.loader.exec_module, module)
        finally:
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader

    def _timed(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        state = _import_state
        outermost = state["depth"] == 0
        t0 = _thread_time() if outermost else 0.0
        state["depth"] += 1
        try:
            return fn(arg)
        finally:
            state["depth"] -= 1
            if outermost:
                thread = _ident()
                spent = _thread_time() - t0
                IMPORT_S[thread] = IMPORT_S.get(thread, 0.0) + spent
                IMPORTS[0] += spent


class ImportWatch:
    """The meta path finder (first on ``sys.meta_path`` while a run is watched): asks the finders after it
    for a module a memcallbacks function imports and wraps its loader in a timer; returns None otherwise."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        state = _import_state
        if state["finding"] or not _started_by_monitor(sys._getframe(1)):
            return None
        state["finding"] = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
        finally:
            state["finding"] = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        IMPORTS[1] += 1
        if len(_import_names) < MAX_IMPORT_NAMES:
            _import_names.append(name)
        spec.loader = _TimedLoader(spec.loader)
        return spec


_IMPORT_WATCH = ImportWatch()


def watch_imports() -> bool:
    """From now on, time the imports the monitor's code starts (a run's start). True."""
    _import_state["watchers"] += 1
    if _IMPORT_WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _IMPORT_WATCH)
    return True


def unwatch_imports() -> bool:
    """Undo one :func:`watch_imports` (a run's end); the finder goes with the last one. False."""
    _import_state["watchers"] = max(0, _import_state["watchers"] - 1)
    if not _import_state["watchers"]:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_IMPORT_WATCH)
    return False


def import_seconds() -> tuple[float, int]:
    """CPU seconds in the imports the monitor's code started, every thread, and how many modules: totals."""
    return IMPORTS[0], IMPORTS[1]


def imported_names() -> list[str]:
    """The first modules the monitor's code imported while watched (at most 16)."""
    return list(_import_names)


# ---------------------------------------------------------------------- torch's hooked call path
_hooked_call_cost: list[float] = []  # [seconds], measured once per process


class _ClosedGate:
    """What a closed gate on a module does (lifecycle.GatedHook's early return): return at once."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False

    def __call__(self, *args: Any) -> None:
        if torch.compiler.is_compiling() or not self.open:
            return None
        return None  # pragma: no cover - never open


def hooked_call_cost_s() -> float:
    """What one hook call on a module costs torch's dispatch, per hook: a module with a forward pre-hook
    and a forward hook (both returning at once, as the plain loop's closed gates) against the same
    module without, half the difference a call. Measured once per process (~2 ms, when the first plain
    monitor with a model is built): the fastest of 5 alternating blocks of 32 calls each way."""
    if not _hooked_call_cost:
        try:
            _hooked_call_cost.append(_measure_hooked_call())
        except Exception:  # a torch that cannot run the probe (a function mode, a compile in progress): no estimate
            _hooked_call_cost.append(0.0)
    return _hooked_call_cost[0]


def _measure_hooked_call(blocks: int = 5, calls: int = 32) -> float:
    class Probe(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x

    bare, hooked = Probe(), Probe()
    hooked.register_forward_pre_hook(_ClosedGate())
    hooked.register_forward_hook(_ClosedGate())
    x = torch.empty(0)
    best = [math.inf, math.inf]
    clock = time.perf_counter
    for _ in range(blocks):
        for i, module in enumerate((bare, hooked)):
            t0 = clock()
            for _ in range(calls):
                module(x)
            best[i] = min(best[i], (clock() - t0) / calls)
    return max(0.0, best[1] - best[0]) / 2
