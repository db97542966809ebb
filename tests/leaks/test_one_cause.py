"""Issue 44 items 1, 2 and 4 at defaults: one cause is one finding, with the cause's kind, the fix for its holder,
what each detector saw as its evidence, the step it was first found at, and a size that is what the holder keeps.

Each case is a real training loop under the plain ``Monitor`` built with nothing but where its files go:

- an exception kept in a local of the step function (pytorch/pytorch#10348): the frame and its traceback make a cycle
  that keeps the step's batch and graph; the graphs of several steps alive at once, the growth, a lingering step are
  all that cycle's evidence;
- a ``LambdaLR`` whose lambda refers to the object that holds it (pytorch/pytorch#47589): each step's optimizer and its
  state wait in a cycle; the collection watch's cycle and the growth of optimizer state are one cause;
- a list on the model that keeps each step's loss with its graph (a hand-made leaf input and its grad): the step-1
  lingering graph is the first sign of the growth it turns into; its holder is the list, its fix the list's.

The 2-rank cases (FSDP2, the seed bug on rank 1 only) are in tests/runtime/test_rank_findings.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import MIB, announced, trainer_kwargs
from memcallbacks import MemoryMonitor, Monitor
from memcallbacks._base.findings import Finding, FindingLog, evidence_of

pytestmark = pytest.mark.usefixtures("one_thread", "collected_heap")


def problems(findings: list[Any]) -> list[Any]:
    return [f for f in findings if f.is_problem]


def verdict(folder: Path) -> list[str]:
    return json.loads((folder / "report.json").read_text())["verdict"]


# ---------------------------------------------------------------------- the log's rules (no training)
def lingering(step: int = 1, **details: Any) -> Finding:
    return Finding(kind="lingering", step=step, key="lingering:graph", message="Step 0's autograd graph was still alive.",
                   bytes=2 * MIB, details={"from_step": step - 1, "graph_alive": True, **details})


def test_a_lingering_graph_that_a_chain_keeps_is_the_growth_it_turns_into() -> None:
    log = FindingLog()
    assert log.add(lingering(held_by=["Net.kept"]))
    chain = Finding(kind="growth", step=4, message="The autograd graphs of steps 0, 1, 2, 3 were alive.", bytes=8 * MIB,
                    details={"evidence": "graph_chain", "graph_steps_alive": [0, 1, 2, 3]})
    assert not log.add(chain) and log.joined is not None
    (cause,) = log.findings
    assert (cause.kind, cause.key, cause.first_step, cause.step, cause.bytes) == ("growth", "growth", 1, 4, 8 * MIB)
    assert [e["key"] for e in cause.evidence] == ["lingering:graph", "growth"] and log.problems() == 1
    assert log.get("lingering:graph") is cause  # the lingering detector's key finds the cause it joined
    log.add(Finding(kind="growth", step=30, message="Memory grew.", bytes=60 * MIB, holders=["Net.kept grew by 26 tensors"]))
    assert (cause.first_step, cause.step, cause.bytes, cause.holders) == (1, 30, 60 * MIB, ["Net.kept grew by 26 tensors"])
    assert cause.evidence[1]["last_step"] == 30
    assert "seen: lingering at step 1 (2.0 MiB)" in str(cause)


def test_a_holder_both_name_joins_and_different_causes_stay_apart() -> None:
    log = FindingLog()
    log.add(lingering(held_by=["Net.kept"]))
    log.add(Finding(kind="growth", step=20, message="grew", bytes=MIB, details={"held_by": ["module m: global CACHE"]}))
    assert len(log) == 2 and log.problems() == 2  # another holder: another cause
    log.add(Finding(kind="growth", step=36, message="grew", bytes=MIB, details={"held_by": ["module m: global CACHE", "Net.kept"]}))
    assert len(log) == 1 and log.findings[0].kind == "growth" and log.findings[0].first_step == 1  # the update named it
    advice = Finding(kind="lingering", step=2, key="lingering:outputs", message="Advice", severity="advice", details={"held_by": ["Net.kept"]})
    assert log.add(advice) and len(log) == 2  # advice is never a cause's evidence


def test_a_cycle_is_the_cause_of_what_it_keeps_in_either_order() -> None:
    log = FindingLog()
    log.add(Finding(kind="growth", step=9, message="grew", bytes=20 * MIB))
    log.add(Finding(kind="cycle", step=12, key="cycle:Foo -> LambdaLR -> Foo", message="cycle", bytes=2 * MIB,
                    details={"cycles": [["Foo", "LambdaLR"]]}))
    assert len(log) == 2
    log.add(Finding(kind="growth", step=25, message="grew", bytes=24 * MIB, details={"cycles": [["Foo", "LambdaLR"]]}))
    (cause,) = log.findings
    assert cause.kind == "cycle" and cause.first_step == 9 and cause.bytes == 24 * MIB, cause  # what it keeps: the most seen
    log.add(Finding(kind="growth", step=40, message="settled", bytes=30 * MIB, state="settled"))
    assert [e["kind"] for e in cause.evidence] == ["growth", "cycle"]  # first seen first
    assert cause.state == "open" and cause.evidence[0]["last_step"] == 40  # the growth's own lifecycle is evidence only


def test_a_cycle_found_from_a_growths_tensors_takes_the_growth_in() -> None:
    """The growth's first census finds its tensors in the cyclic garbage of a cycle already found (under load the
    collection watch saw it first): the cycle it reports joins that one, and the growth's later updates are evidence."""
    for key in ("cycle:Trial -> LambdaLR", "cycle:LambdaLR -> Trial"):  # where its description starts may differ
        for growth_stored_first in (False, True):
            log = FindingLog()
            log.add(Finding(kind="cycle", step=6, key="cycle:Trial -> LambdaLR", message="cycle", bytes=2 * MIB,
                            details={"cycles": [["Trial", "LambdaLR"]]}))
            growth = Finding(kind="growth", step=11, message="Memory grew.", bytes=8 * MIB)
            if growth_stored_first:
                log.add(growth)
            log.add(Finding(kind="cycle", step=11, key=key, message="The tensors were in cycles.", bytes=8 * MIB,
                            details={"cycles": [["Trial", "LambdaLR"]]}, evidence=[evidence_of(growth)]))
            log.add(Finding(kind="growth", step=27, message="Memory grew.", bytes=12 * MIB, first_step=11,
                            holders=["optimizer state grew by 4 tensors"]))
            (cause,) = log.findings
            assert (cause.kind, cause.first_step, log.problems()) == ("cycle", 6, 1), (key, growth_stored_first)
            (seen,) = [e for e in cause.evidence if e["kind"] == "growth"]
            assert seen["last_step"] == 27 and seen["holders"] == ["optimizer state grew by 4 tensors"]


def test_another_ranks_same_finding_is_one_cause_on_both_ranks() -> None:
    log = FindingLog()
    log.add(Finding(kind="growth", step=4, message="grew", bytes=MIB, details={"held_by": ["Net.kept"]}))
    other = Finding(kind="growth", step=5, key="rank1:growth", message="rank 1: grew", bytes=MIB,
                    details={"held_by": ["Net.kept"], "rank": 1})
    assert not log.add(other) and len(log) == 1 and log.findings[0].details["ranks"] == [0, 1]
    only = Finding(kind="lingering", step=1, key="rank1:lingering:graph", message="rank 1: kept", details={"rank": 1})
    assert log.add(only) and len(log) == 2  # found on rank 1 alone: its own finding, named by rank


def test_an_update_does_not_change_the_cause_a_finding_named() -> None:
    """Accelerate's cv_example with a cache filled inside its workers: the live finding said so; at the run's end the
    workers' Dataset could not be measured any more and the same finding said copy on access, with the wrong fix."""
    log = FindingLog()
    log.add(Finding(kind="worker_growth", step=26, message="grows inside the workers. Fix: drop the cache.", bytes=100 * MIB,
                    details={"cause": "inside_workers"}))
    log.add(Finding(kind="worker_growth", step=90, message="Copy on access. Fix: NumPy arrays.", bytes=120 * MIB,
                    details={"cause": "copy_on_access"}))
    (cause,) = log.findings
    assert cause.details["cause"] == "inside_workers" and "inside the workers" in cause.message
    assert (cause.step, cause.bytes) == (90, 120 * MIB) and cause.details["other_cause_seen"]["cause"] == "copy_on_access"


# ---------------------------------------------------------------------- an exception kept in a local
def check(loss: torch.Tensor) -> None:
    if loss.item() > -1:
        raise ValueError("the loss looks odd")


def test_an_exception_kept_in_a_local_is_one_cycle(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, output_dir=str(tmp_path), plot=False)

    def train_step(batch: torch.Tensor) -> float:
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        try:
            check(loss)
        except ValueError as exc:
            error = exc  # BUG: exc -> its traceback -> this frame -> error (and batch, loss): a cycle  # noqa: F841
        return loss.item()

    for batch in monitor.track(torch.randn(512, 512) for _ in range(40)):  # 1 MiB batches
        train_step(batch)
    monitor.close()

    (cause,) = problems(monitor.findings)
    assert cause.kind == "cycle" and cause.key.startswith("cycle:"), str(cause)
    assert any("traceback" in h and "frame" in h for h in cause.holders), cause.holders
    assert "do not keep the exception" in cause.message and "loop until the next step rebinds" not in cause.message
    assert cause.first_step <= 6 and cause.bytes >= 4 * MIB, str(cause)
    # the other detectors saw this cycle: the graphs of several steps alive, the growth, a lingering step
    assert {e["kind"] for e in cause.evidence} >= {"growth"}, cause.evidence
    head, *lines = verdict(tmp_path)
    assert head.startswith("memcallbacks: 1 problem found in 40 steps") and len(lines) == 1, (head, lines)
    assert lines[0].startswith(f"  - cycle, step {cause.first_step}"), lines
    # said once in the log: the cycle; the rest joined it
    assert len([r for r in announced(caplog) if "found a memory problem" in r.getMessage()]) == 1, [r.getMessage() for r in announced(caplog)]


ERRORS: list[Exception] = []


def test_an_exception_kept_in_a_list_gets_the_fix_for_a_kept_exception(tmp_path: Path, caplog: Any) -> None:
    """``errors.append(e)`` in an ``except`` block: the list keeps each exception, whose traceback keeps the frame of the
    step and its loss with the graph. The holder names the list through the traceback, and the fix is a kept
    exception's (keep ``str(e)`` or ``e.with_traceback(None)``), not a running total's or a cache's (user check)."""
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, output_dir=str(tmp_path), plot=False)

    def train_step(batch: torch.Tensor) -> float:
        loss = model(batch).pow(2).mean()
        try:
            check(loss)
        except ValueError as exc:
            ERRORS.append(exc)  # BUG: exc -> its traceback -> this frame -> loss and its graph
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    try:
        for batch in monitor.track(torch.randn(512, 512) for _ in range(40)):  # 1 MiB batches
            train_step(batch)
        monitor.close()
    finally:
        ERRORS.clear()
    (cause,) = problems(monitor.findings)
    assert cause.kind == "growth" and any("global ERRORS" in h for h in cause.holders), str(cause)
    assert "`e.with_traceback(None)`" in cause.message and "Fix: keep `str(e)`" in cause.message, cause.message
    first = [r.getMessage() for r in announced(caplog) if "found a memory problem" in r.getMessage()]
    assert len(first) == 1 and "traceback" in first[0], first
    assert "`e.with_traceback(None)`" in first[0] and "Accumulate `loss.detach()`" not in first[0], first[0]
    (line,) = verdict(tmp_path)[1:]
    assert "fix: keep `str(e)` or `repr(e)`" in line, line


# ---------------------------------------------------------------------- a LambdaLR whose lambda holds its owner
def test_a_lambda_lr_that_holds_its_owner_is_one_cycle(tmp_path: Path) -> None:
    weight = nn.Linear(512, 512)

    class Trial:  # pytorch/pytorch#47589, as reported: a new optimizer and scheduler for every run of the step
        def __init__(self) -> None:
            self.lr = 1.0
            self.op = torch.optim.Adam(weight.parameters())
            self.sc = torch.optim.lr_scheduler.LambdaLR(self.op, lr_lambda=lambda s: self.lr)  # BUG: refers to self

        def run(self, batch: torch.Tensor) -> None:
            loss = weight(batch).mean()
            self.op.zero_grad()
            loss.backward()
            self.op.step()
            self.sc.step()

    monitor = Monitor(weight, output_dir=str(tmp_path), plot=False)
    for batch in monitor.track(torch.randn(64, 512) for _ in range(40)):
        Trial().run(batch)
    monitor.close()

    (cause,) = problems(monitor.findings)
    assert cause.kind == "cycle" and "LambdaLR" in cause.key, str(cause)
    # the cycle (where its description starts depends on which tensor it was found from) and the optimizer state it holds
    assert any("Trial" in h and "LambdaLR" in h and ".state[" in h for h in cause.holders), cause.holders
    assert "the scheduler's function refers back" in cause.message, cause.message
    # the growth of optimizer state it causes is its evidence, not a second problem
    assert {e["kind"] for e in cause.evidence} == {"cycle", "growth"}, cause.evidence
    (growth,) = [e for e in cause.evidence if e["kind"] == "growth"]
    assert any(h.startswith("optimizer state grew by") for h in growth["holders"]), growth
    assert cause.bytes >= growth["bytes"] >= 4 * MIB  # sized by what the cycle keeps: the growth
    assert verdict(tmp_path)[0].startswith("memcallbacks: 1 problem found in 40 steps")


# ---------------------------------------------------------------------- a list on the model keeps each step's loss
class KeepsLosses(nn.Module):
    """A list on the model keeps each step's loss: its graph keeps the hand-made leaf input (1 MiB) and its grad."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
        self.kept: list[torch.Tensor] = []

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        loss = self.net(emb).pow(2).mean()
        self.kept.append(loss)  # BUG: the loss with its graph, every step
        return loss


def test_a_list_that_keeps_each_loss_is_one_growth_from_step_1(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    torch.manual_seed(0)
    model = KeepsLosses()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(model, opt, output_dir=str(tmp_path), plot=False)
    for _ in monitor.track(range(48)):
        emb = torch.randn(1024, 256).requires_grad_()  # 1 MiB, and 1 MiB of grad: 2 MiB kept a step
        model(emb).backward()
        opt.step()
        opt.zero_grad()
        del emb
    monitor.close()

    (cause,) = problems(monitor.findings)
    assert cause.kind == "growth" and cause.key == "growth", str(cause)
    assert cause.first_step == 1 and cause.step > 4, str(cause)  # first raised as the lingering graph of step 0
    assert [e["kind"] for e in cause.evidence][:2] == ["lingering", "growth"], cause.evidence
    assert cause.evidence[0]["holders"][0].startswith("KeepsLosses.kept[0] -> autograd graph"), cause.evidence
    # the graph chain's size: every step's graph it found alive (4 steps of 2 MiB), not the oldest one's
    chain = next(e for e in cause.evidence if e["kind"] == "growth")
    assert chain["bytes"] >= 4 * 2 * MIB - 64 * 1024, chain
    # the holder, its size and its fix: what the list keeps through the graphs, within 20% of the allocated growth
    assert cause.details["held_by"][0] == "KeepsLosses.kept", cause.details
    assert cause.holders[0].startswith("KeepsLosses.kept grew by ") and "through their autograd graphs" in cause.holders[0]
    assert cause.holders[0].endswith("it keeps 144 tensors / 96.0 MiB alive in all"), cause.holders  # 48 losses, leaves, grads
    assert abs(cause.details["holder_bytes"] - cause.bytes) <= 0.2 * cause.bytes, (cause.details["holder_bytes"], cause.bytes)
    assert "Fix: `KeepsLosses.kept` gets tensors every step" in cause.message
    assert "rebinds the variable" not in cause.message
    # the lingering warning at step 1 named the list and its fix, not a loop variable
    first = announced(caplog)[0].getMessage()
    assert "[lingering] step 1:" in first and "`KeepsLosses.kept` keeps them" in first and "rebinds" not in first, first
    head, line = verdict(tmp_path)[:2]
    assert head.startswith("memcallbacks: 1 problem found in 48 steps"), head
    assert line.startswith("  - growth, step 1 (confirmed again at step "), line
    assert "fix: `KeepsLosses.kept` gets tensors every step" in line, line
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(f["kind"], f["first_step"]) for f in report["findings"] if f["state"] == "open"] == [("growth", 1)]
    del model.kept[:]


# ---------------------------------------------------------------------- a Lightning module keeps a tensor a step
class KeepsOutputs(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 512)
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.net(batch)
        self.kept.append(out.detach())  # BUG: 256 KiB every step
        return out.pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_kept_tensor_is_sized_by_what_the_list_holds_at_the_end(tmp_path: Path) -> None:
    """The holder line says what the list keeps when the run ends, as the growth does (item 2: the message said
    "+18.3 MiB" and its holder line "grew by 20 tensors / 2.5 MiB" while the list held 150)."""
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    model = KeepsOutputs()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=100, callbacks=[monitor]))
    trainer.fit(model, DataLoader(torch.randn(100 * 128, 64), batch_size=128))
    (cause,) = problems(monitor.findings)
    assert cause.kind == "growth" and cause.details["held_by"][0] == "KeepsOutputs.kept", str(cause)
    assert cause.holders[0].endswith("it keeps 100 tensors / 25.0 MiB alive in all"), cause.holders
    assert abs(cause.details["holder_bytes"] - cause.bytes) <= 0.2 * cause.bytes, (cause.details["holder_bytes"], cause.bytes)
    saved = json.loads((tmp_path / "mem" / "report.json").read_text())["findings"]
    assert [f["holders"] for f in saved if f["kind"] == "growth"] == [cause.holders]  # the live finding is the file's
    del model.kept[:]


class KeepsLossGraphs(L.LightningModule):
    """Each step's loss kept with its graph in a list on the module (a user check: the graphs are small after
    ``backward()``, so the chain of graphs finds it, at step 4, before any census)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1))
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).pow(2).mean()
        self.kept.append(loss)  # BUG: the loss with its graph, every step
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_chain_of_graphs_kept_in_a_list_gets_the_lists_fix(tmp_path: Path) -> None:
    """Its fix is the list's (keep ``loss.item()`` in ``KeepsLossGraphs.kept``), not a running total's."""
    monitor = MemoryMonitor(output_dir=str(tmp_path / "mem"), plot=False)
    model = KeepsLossGraphs()
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=12, callbacks=[monitor]))
    trainer.fit(model, DataLoader(torch.randn(12 * 256, 256), batch_size=256))
    (cause,) = problems(monitor.findings)
    assert cause.kind == "growth" and cause.holders[0].startswith("KeepsLossGraphs.kept[0] -> autograd graph"), str(cause)
    assert "in `KeepsLossGraphs.kept`" in cause.message and "running total" not in cause.message, cause.message
    del model.kept[:]
