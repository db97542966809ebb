"""Every private PyTorch API memcallbacks touches lives here, behind one signature each."""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch

log = logging.getLogger(__name__)

__all__ = [
    "cuda_stats_reader",
    "cuda_peak_resetter",
    "cuda_record_memory_history",
    "cuda_stop_memory_history",
    "cuda_memory_history_enabled",
    "cuda_memory_snapshot",
    "cuda_attach_oom_observer",
    "ProfilerAllocation",
    "profiler_memory_events",
    "profiler_enabled",
    "cuda_memory_fraction",
    "is_autograd_node",
    "is_autograd_node_type",
    "saved_tensors_of",
    "node_metadata",
    "fsdp2_param_dtype",
    "lazily_disabled",
]


def lazily_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)`` that imports ``torch._dynamo`` at its first call, not now.

    ``torch.compiler.disable`` imports dynamo when it decorates: a second of every process's
    ``import memcallbacks`` (torch 2.13 on CPU), for a path only a compiled model takes. torch's own
    ``torch._disable_dynamo`` defers it (dynamo does not trace ``torch/_compile.py``: a call from a
    compiled region breaks the graph and runs eagerly). ``torch.compiler.disable`` where it is gone."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if callable(lazy) else torch.compiler.disable(fn)


def cuda_stats_reader(index: int) -> Callable[[], dict[str, Any]]:
    """Return a zero-argument callable giving CUDA allocator stats as torch's *nested* dict.

    ``torch.cuda.memory_stats()`` flattens the nested dict in Python on every call (and
    ``torch.cuda.memory_allocated()`` builds that whole flat dict to read one number); the C
    binding returns the nested dict directly, which is several times cheaper. The public API is
    the fallback when the binding is missing or changes name.
    """
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            stats = raw(index)
            stats["allocated_bytes"]["all"]["current"]
            return lambda: raw(index)
        except Exception:  # pragma: no cover - depends on torch build
            log.debug("torch._C._cuda_memoryStats unusable; using torch.cuda.memory_stats", exc_info=True)
    return lambda: _unflatten(torch.cuda.memory_stats(index))


def cuda_peak_resetter(index: int) -> Callable[[], None]:
    """Return a zero-argument callable resetting the CUDA allocator's peak statistics."""
    raw = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.reset_peak_memory_stats(index)


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


# ----------------------------------------------------------------------------------------------
# Allocator history, snapshots and the OOM observer (CUDA), and the profiler's memory events (CPU)
# ----------------------------------------------------------------------------------------------


def cuda_record_memory_history(max_entries: int, stacks: str = "python") -> None:
    """Turn on the CUDA caching allocator's history: live blocks and a ring buffer of trace entries.

    ``torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks=...,
    max_entries=...)``: ``stacks="python"`` records Python frames only (C++ symbolisation at dump
    time is slow); the ring buffer keeps the newest ``max_entries`` alloc/free events.
    ``context="alloc"`` captures a stack per allocation only (``"all"`` also captures one on every
    free, twice the cost); a free entry then carries its block's allocation stack, which is what
    the summary reads.
    """
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks=stacks, max_entries=max_entries)


def cuda_stop_memory_history() -> None:
    """Turn the CUDA allocator's history off (``_record_memory_history(enabled=None)``); a no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_history_enabled() -> bool:
    """Whether the CUDA allocator is recording history now (False without CUDA or on old torch)."""
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if probe is None or not torch.cuda.is_available():
        return False
    try:
        return bool(probe())
    except Exception:  # pragma: no cover - depends on torch build
        return False


def cuda_memory_snapshot() -> dict[str, Any]:
    """The allocator's state and trace as torch's plain dict (``torch.cuda.memory._snapshot()``)."""
    return torch.cuda.memory._snapshot()


_oom_callbacks: list[Callable[[int, int, int, int], None]] = []
_oom_trampoline_attached = False


def _oom_trampoline(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    for callback in list(_oom_callbacks):
        try:
            callback(device, alloc, device_allocated, device_free)
        except Exception:  # an exception here would escape through the allocator
            log.exception("memcallbacks: CUDA out-of-memory observer failed")


def cuda_attach_oom_observer(callback: Callable[[int, int, int, int], None]) -> Callable[[], None]:
    """Call ``callback(device, requested_bytes, device_limit, device_free)`` when the CUDA allocator runs out
    (``device_limit``: the device's total memory, or the per-process limit when one is set).

    torch can attach observers (``torch._C._cuda_attach_out_of_memory_observer``) but never detach
    them, so one trampoline is attached per process and callbacks come and go behind it. The
    callback runs inside the failing allocation, before ``torch.OutOfMemoryError`` is raised:
    dump a snapshot there, do not allocate on the device. Returns ``detach()``, safe to call twice.
    """
    global _oom_trampoline_attached
    if not _oom_trampoline_attached:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None or not torch.cuda.is_available():
            raise RuntimeError("an out-of-memory observer needs CUDA (torch._C._cuda_attach_out_of_memory_observer).")
        attach(_oom_trampoline)
        _oom_trampoline_attached = True
    _oom_callbacks.append(callback)

    def detach() -> None:
        try:
            _oom_callbacks.remove(callback)
        except ValueError:
            pass

    return detach


class ProfilerAllocation(NamedTuple):
    """One allocator event from a ``torch.profiler`` run with ``profile_memory=True``."""

    time_ns: int
    ptr: int
    nbytes: int
    """Positive for an allocation, negative for a free."""
    device_type: str
    device_index: int
    op: str
    """The outermost torch op below the innermost Python frame (``"aten::linear"``), or ``""``."""
    frames: tuple[tuple[str, int, str], ...]
    """Python frames ``(filename, line, function)``, innermost first; empty without ``with_stack``."""


def profiler_memory_events(prof: Any, marker: str) -> tuple[list[ProfilerAllocation], list[int]]:
    """Allocator events of a stopped ``torch.profiler.profile`` and the times of ``record_function(marker)`` ranges.

    Reads the profiler's event tree (``prof.profiler.kineto_results.experimental_event_tree()``):
    allocation events sit under the ops and Python calls that made them, so each gets the Python
    stack of its call (a C function's ``caller`` gives the calling line; a Python function's
    ``caller`` gives its caller's line; when the innermost Python frame is a function with no C
    call below it, its definition line stands in for the unknown current line).
    """
    from torch._C._profiler import _EventType

    alloc_tag, torch_op, py_call, py_c_call = (
        _EventType.Allocation, _EventType.TorchOp, _EventType.PyCall, _EventType.PyCCall,
    )
    events: list[ProfilerAllocation] = []
    marks: list[int] = []
    roots = prof.profiler.kineto_results.experimental_event_tree()
    # (node, python frames of the parent chain, innermost op, innermost Python node was a PyCall's callsite)
    todo: list[tuple[Any, tuple[tuple[str, int, str], ...], str, tuple[str, int, str] | None]] = [
        (node, (), "", None) for node in reversed(roots)
    ]
    while todo:
        node, frames, op, callsite = todo.pop()
        tag = node.tag
        if tag == alloc_tag:
            f = node.extra_fields
            stack = frames if callsite is None else (callsite,) + frames
            device = f.device
            events.append(ProfilerAllocation(
                int(node.start_time_ns), int(f.ptr), int(f.alloc_size), device.type,
                device.index if device.index is not None else 0, op, stack,
            ))
            continue
        if tag == torch_op:
            name = node.name
            if name == marker:
                marks.append(int(node.start_time_ns))
            op = op or name
        elif tag == py_c_call:
            frames = (_frame(node.extra_fields.caller),) + frames
            callsite = None
        elif tag == py_call:
            fields = node.extra_fields
            frames = (_frame(fields.caller),) + frames
            callsite = _frame(fields.callsite)
        if tag in (py_call, py_c_call):
            op = ""  # ops called below this Python frame are its own
        for child in reversed(node.children):
            todo.append((child, frames, op, callsite))
    events.sort(key=lambda e: e.time_ns)
    marks.sort()
    return events, marks


def _frame(code: Any) -> tuple[str, int, str]:
    """A profiled Python frame as (file, line, function). The profiler reads a code object's names after the
    capture: one freed meanwhile (a module imported inside the capture runs code that is then dropped) can read
    as undecodable bytes (seen once in a test run); that frame is named as unknown, the rest of the stack kept."""
    try:
        return code.file_name, int(code.line_number), code.function_name
    except UnicodeDecodeError:
        return "<unknown>", 0, "<a code object freed during the capture>"


def profiler_enabled() -> bool:
    """Whether a torch profiler session is running now (a second one would take its events away)."""
    probe = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(probe()) if probe is not None else False


def cuda_memory_fraction(index: int) -> float:
    """The fraction of device ``index`` this process may use (``set_per_process_memory_fraction``);
    1.0 where torch cannot say (before torch 2.6 there is no getter)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        fraction = float(getter(index))
    except Exception:
        return 1.0
    return fraction if 0.0 < fraction <= 1.0 else 1.0
# ----------------------------------------------------------------------------------------------
# Autograd-node introspection: what a graph node keeps for backward, and its metadata dict
# ----------------------------------------------------------------------------------------------

# Per node type: (is a node, names of its tensor-valued saved attributes, is a Python autograd.Function ctx)
_NODE_INFO: dict[type, tuple[bool, tuple[str, ...], bool]] = {}


def node_info(tp: type) -> tuple[bool, tuple[str, ...], bool]:
    """What :func:`saved_tensors_of` needs to know about a node type, worked out once per type.

    C++ nodes expose each saved variable twice: ``_raw_saved_x`` (a ``SavedTensor`` handle) and
    ``_saved_x`` (the unpacked tensor); the raw names list what a node type saves. Python
    ``autograd.Function`` contexts derive from ``torch._C._FunctionBase``.
    """
    info = _NODE_INFO.get(tp)
    if info is None:
        is_node = hasattr(tp, "next_functions") and hasattr(tp, "register_hook") and hasattr(tp, "name")
        saved: tuple[str, ...] = ()
        is_python = False
        if is_node:
            names = dir(tp)
            saved = tuple("_saved_" + n[len("_raw_saved_"):] for n in names if n.startswith("_raw_saved_"))
            is_python = issubclass(tp, torch._C._FunctionBase)
        info = (is_node, saved, is_python)
        _NODE_INFO[tp] = info
    return info


def is_autograd_node_type(tp: type) -> bool:
    """Whether objects of type ``tp`` are autograd graph nodes (``grad_fn`` objects, cached per type)."""
    return node_info(tp)[0]


def is_autograd_node(obj: Any) -> bool:
    """Whether ``obj`` is an autograd graph node (a ``grad_fn``, ``AccumulateGrad``, a Function ctx)."""
    return node_info(type(obj))[0]


def saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """Tensors an autograd node keeps for backward; never raises.

    C++ nodes: every ``_saved_<name>`` that is a tensor or a list of tensors (gone after
    ``backward()`` unless ``retain_graph``). Python ``autograd.Function`` nodes: ``ctx.saved_tensors``
    and tensors stored as attributes on ``ctx`` (``ctx.foo = tensor``).
    """
    out: list[torch.Tensor] = []
    _, saved, is_python = node_info(type(node))
    for name in saved:
        try:
            value = getattr(node, name)
        except Exception:  # freed by backward, or not a tensor after all
            continue
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    if is_python:
        try:
            out.extend(v for v in node.saved_tensors if isinstance(v, torch.Tensor))
        except Exception:
            pass
        try:  # attributes stored on ctx (ctx.foo = tensor)
            out.extend(v for v in vars(node).values() if isinstance(v, torch.Tensor))
        except Exception:
            pass
    return out


def node_metadata(node: Any) -> dict[Any, Any]:
    """The node's ``metadata`` dict (``grad_fn.metadata``): it lives and dies with the node.

    Raises ``AttributeError``/``RuntimeError`` for exotic node types that have none.
    """
    return node.metadata
def fsdp2_param_dtype(module: Any) -> torch.dtype | None:
    """The ``param_dtype`` of the ``MixedPrecisionPolicy`` a ``fully_shard``-ed module was given
    (``None``: no policy, or not readable). torch has no public accessor: this reads the module's
    FSDP state (``_get_fsdp_state()._mp_policy``, torch 2.6-2.13)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        dtype = get_state()._mp_policy.param_dtype
    except Exception:
        return None
    return dtype if isinstance(dtype, torch.dtype) else None
