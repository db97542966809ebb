"""The lingering and graph-chain findings' text: what was still alive, the usual cause and the fix.

Or the advice when it is one step's outputs kept by a loop variable (bounded, not a leak)."""

from __future__ import annotations

from memcallbacks._base.findings import Finding
from memcallbacks._base.units import format_bytes

__all__ = ["chain_finding", "lingering_finding"]


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


def chain_finding(step: int, steps_alive: list[int], nbytes: int, holders: list[str]) -> Finding:
    """The ``growth`` finding for a graph chain seen at the start of ``step``."""
    shown = ", ".join(str(s) for s in steps_alive)
    return Finding(
        kind="growth",
        key="growth",
        step=step,
        bytes=int(nbytes),
        message=(
            f"The autograd graphs of steps {shown} were all still alive when step {step} started "
            f"({format_bytes(nbytes)} of tensors in them besides parameters): something links every step's "
            "graph to the next and keeps them all, usually a running total without `.detach()` "
            "(`self.total = self.total + loss`), an evaluation without `torch.no_grad()` summed into a "
            "variable, or outputs kept with their graphs in a list. After `backward()` each graph is "
            "small, but their number (nodes, saved tensors of graphs never backpropagated) grows every "
            "step without bound. Accumulate `loss.detach()` or `loss.item()`, evaluate under "
            "`torch.no_grad()`, keep `.detach()`ed outputs. The holders show the variable."
        ),
        holders=holders,
        details={"evidence": "graph_chain", "graph_steps_alive": list(steps_alive), "graph_bytes": int(nbytes)},
    )
