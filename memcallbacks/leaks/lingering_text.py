"""The lingering and graph-chain findings' text: what was still alive, the usual cause and the fix.

Or the advice when it is one step's outputs kept by a loop variable (bounded, not a leak)."""

from __future__ import annotations

import re

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes

__all__ = ["chain_finding", "exception_fix", "growth_fix", "holder_cause", "lingering_finding", "through_exception"]


def lingering_finding(
    step: int, from_step: int, key: str, n: int, graph: bool, batch_bytes: int, total: int,
    outputs: list[str], output_bytes: int,
) -> Finding:
    """The ``lingering`` finding at ``step`` for step ``from_step``'s leftovers: ``n`` batch tensors
    (``batch_bytes``), the autograd graph when ``graph``, the model ``outputs`` described
    (``output_bytes``); ``total`` bytes in all."""
    graph_bytes = total - batch_bytes - output_bytes
    what = []
    if n:
        what.append(f"{n} tensor{'s' if n != 1 else ''} of its batch ({format_bytes(batch_bytes)})")
    if outputs:
        what.append(f"model output{'s' if len(outputs) != 1 else ''} {', '.join(outputs[:3])} ({format_bytes(output_bytes)})")
    if graph:
        what.append(f"its autograd graph (holding {format_bytes(graph_bytes)} more)" if what else f"autograd graph (holding {format_bytes(graph_bytes)})")
    verb = "were" if len(what) > 1 or n > 1 or len(outputs) > 1 else "was"
    cause = _cause(bool(outputs) and not graph)
    message = (
        f"Step {from_step}'s {' and '.join(what)} {verb} still alive when step {step} started, "
        f"{format_bytes(total)} in all. {cause} The holders show where the reference lives."
    )
    # One step's outputs, kept by a loop variable until the next step rebinds it: the outputs of
    # two steps ago were dead (retention is the growth detector's), so this is bounded, not a
    # leak; what it costs is its size on top of the next forward's peak.
    advice = bool(outputs) and not graph and not n
    if advice:
        message = (
            f"Advice (not a leak): step {from_step}'s {' and '.join(what)} {verb} still alive when step {step} "
            f"started and through its forward, adding {format_bytes(total)} to that step's peak. It is one step "
            "of retention, freed when the loop rebinds the variable, so memory does not grow. "
            + cause.replace("Something keeps", "The loop keeps", 1) + " The holders show where the reference lives."
        )
    return Finding(
        kind="lingering",
        step=step,
        key=key,
        bytes=int(total),
        message=message,
        severity="advice" if advice else "problem",
        details={
            "peak_cost_bytes": int(total),
            "from_step": from_step,
            "batch_tensors_alive": n,
            "graph_alive": graph,
            "batch_bytes": int(batch_bytes),
            "graph_bytes": int(graph_bytes),
            "outputs_alive": len(outputs),
            "output_bytes": int(output_bytes),
        },
    )


def _cause(outputs_only: bool) -> str:
    """The usual cause and the fix: a kept forward output, or a kept loss with its graph."""
    if outputs_only:
        return (
            "Something keeps the forward output from one step to the next, usually a loop variable "
            "(`logits = model(x)`, `outputs = model(**batch)`) that lives until the next step rebinds "
            "it, so two steps' outputs are alive at the next forward. `del logits` (or `del outputs`) "
            "once the loss is computed, or keep only what you need (`preds = logits.argmax(-1)`)."
        )
    return (
        "Something keeps them from one step to the next, usually "
        "a loss returned with its graph and kept by the loop until the next step rebinds the "
        "variable (`return {\"loss\": loss}`, `outputs = train_one_step(batch)`): the graph holds "
        "the inputs that require grad and their gradients. Return `loss.item()` (or "
        "`loss.detach()`), or `del outputs, batch` at the end of the loop body."
    )


_LOOP_CAUSE = " Something keeps them from one step to the next, usually"


def _root(holder: str) -> tuple[str, str]:
    """A holder path's root without its source location (``Net.kept[0]``, ``module m: global KEPT[0]['loss']``) and
    that root without its subscripts, the container the code names (``Net.kept``, ``module m: global KEPT``)."""
    where = re.sub(r" \([^()]*:\d+\)$", "", holder.split(" -> ")[0])
    return where, re.sub(r"(\[[^\[\]]*\])+$", "", where)


def holder_cause(message: str, holder: str) -> str:
    """The lingering ``message`` with the cause and fix that apply to its first ``holder``: a loop variable the next step
    rebinds (the usual cause, already said), an entry of a list or dict that keeps every step's (the first sign of growth),
    or an attribute that keeps the last step's until it is overwritten."""
    if _LOOP_CAUSE not in message:
        return message
    where, bare = _root(holder)
    name, code = _named(bare), _code(bare)
    indexed = re.search(r"\[\d+\]", where) is not None  # an entry of a list
    if through_exception(holder):
        cause = f" {name} keeps an exception, whose traceback keeps them." + exception_fix(holder)
    elif " local " in where and re.fullmatch(r"\w+(\[[^\[\]]*\])*", where.split(" local ", 1)[1]) and not indexed:
        return message  # a variable of the loop (or a dict it is bound to): rebound by the next step
    elif indexed:
        cause = (f" {name} keeps them: an entry of a list (or a dict) that holds a step's tensors with their autograd graph "
                 "(the graph holds the inputs that require grad and their gradients). If it gets an entry every step, this "
                 f"is the first sign of growth. Keep `loss.item()` or `loss.detach()` in `{code}`, or clear it once its "
                 "entries are used.")
    else:
        cause = (f" {name} keeps them until it is overwritten: an attribute (or global) that holds the last step's tensors "
                 "with their autograd graph (the graph holds the inputs that require grad and their gradients). Store "
                 f"`loss.detach()` or `loss.item()` in `{code}`, or set it to None once it is used.")
    head_text, _sep, rest = message.partition(_LOOP_CAUSE)
    tail = rest.split(" The holders show", 1)
    return head_text + cause + (" The holders show" + tail[1] if len(tail) > 1 else "")


def through_exception(path: str) -> bool:
    """Whether a holder path reaches its tensors through an exception's traceback (``errors[0] -> traceback -> frame
    -> frame step() local out``): a kept exception, whose traceback keeps the frames it passed through."""
    return re.search(r" -> traceback\b", path) is not None


def exception_fix(holder: str) -> str:
    """The fix for tensors a kept exception keeps (``holder``: the path, or its container): its traceback keeps the
    frame it was raised in and every local of that step (pytorch/pytorch#10348)."""
    bare = _root(holder)[1]
    return (f" Fix: keep `str(e)` or `repr(e)` in {_named(bare)}, or `e.with_traceback(None)` (the "
            "exception without its traceback), not the exception itself: an exception's traceback keeps the frames it "
            "passed through alive with every local of that step in them (its batch, outputs and loss, with their autograd "
            "graph; pytorch/pytorch#10348).")


def growth_fix(holder: str, through_graphs: bool, exception: bool = False) -> str:
    """The fix sentence a growth finding ends with once its censuses named the ``holder`` that grew most
    (``through_graphs``: what it keeps grew mostly through the autograd graphs of its tensors; ``exception``: its
    paths go through an exception's traceback, :func:`through_exception`)."""
    if exception and not holder.startswith("("):
        return exception_fix(holder)
    if holder.startswith("(") or " -> " in holder:  # no root, or a path through an object the fix cannot name
        return ""
    if " local " in holder and through_graphs:  # a variable rebound each step to a tensor whose graph reaches the last one's
        return (f" Fix: {_named(holder)} links every step's autograd graph to the next (it is computed from its own value of the "
                f"step before): `.detach()` it at each step (`{_code(holder)} = {_code(holder)}.detach()`; for a tuple, detach each "
                "part), or keep `.item()` values.")
    graphs = (" (each one keeps its autograd graph: the inputs that require grad, their gradients)" if through_graphs else "")
    return (f" Fix: {_named(holder)} gets tensors every step{graphs}: keep `.item()` or `.detach()` values in "
            f"`{_code(holder)}`, bound it (`collections.deque(maxlen=...)`) or clear it once its entries are used.")


def _code(holder: str) -> str:
    """``SEEN``, ``hist``, ``FSDPBlocks.kept``: a holder as the code names it."""
    return holder.partition(": global ")[2] or holder.partition(" local ")[2] or holder


def _named(holder: str) -> str:
    """```SEEN``` (a global of module m), ```history``` (a local of train()), ```FSDPBlocks.kept```: a holder as code."""
    if ": global " in holder:
        module, _g, name = holder.partition(": global ")
        return f"`{name}` (a global of {module})"
    if " local " in holder:
        where, _l, name = holder.partition(" local ")
        return f"`{name}` (a local of {where})"
    return f"`{holder}`"


def chain_finding(step: int, steps_alive: list[int], nbytes: int, holders: list[str]) -> Finding:
    """The ``growth`` finding for a graph chain seen at the start of ``step``; the fix for a kept exception when
    the first holder reaches the graphs through a traceback (:func:`through_exception`)."""
    shown = ", ".join(str(s) for s in steps_alive)
    cause = (
        "something links every step's "
        "graph to the next and keeps them all, usually a running total without `.detach()` "
        "(`self.total = self.total + loss`), an evaluation without `torch.no_grad()` summed into a "
        "variable, or outputs kept with their graphs in a list. After `backward()` each graph is "
        "small, but their number (nodes, saved tensors of graphs never backpropagated) grows every "
        "step without bound. Accumulate `loss.detach()` or `loss.item()`, evaluate under "
        "`torch.no_grad()`, keep `.detach()`ed outputs."
    )
    where, bare = _root(holders[0]) if holders else ("", "")
    if holders and through_exception(holders[0]):
        cause = "the exceptions kept from every step keep them, through their tracebacks." + exception_fix(holders[0])
    elif re.search(r"\[\d+\]", where):  # an entry a step in a list (or a dict of lists): each entry keeps its step's graph
        cause = (f"{_named(bare)} keeps them: it gets a step's tensors with their autograd graph every step (the graph "
                 "holds the inputs that require grad and their gradients). After `backward()` each graph is small, but "
                 f"their number grows every step without bound. Keep `loss.item()` or `loss.detach()` in `{_code(bare)}`, "
                 "bound it (`collections.deque(maxlen=...)`) or clear it once its entries are used.")
    return Finding(
        kind="growth",
        key="growth",
        step=step,
        bytes=int(nbytes),
        message=(
            f"The autograd graphs of steps {shown} were all still alive when step {step} started "
            f"({format_bytes(nbytes)} of tensors in them besides parameters): {cause} The holders show the variable."
        ),
        holders=holders,
        details={"evidence": "graph_chain", "graph_steps_alive": list(steps_alive), "graph_bytes": int(nbytes)},
    )
