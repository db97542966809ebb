"""The leak zoo re-run as a plain PyTorch loop (``Monitor``) and as an Accelerate loop
(``AccelerateMemoryMonitor``): the same core must find the same bugs with the same holders."""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

import pytest
import torch
from torch import nn

from memcallbacks import Monitor

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from memcallbacks.accelerate import AccelerateMemoryMonitor  # noqa: E402

SEEN: list[torch.Tensor] = []  # the module-level global of the "global list" bug
CONFIG = dict(sample_every_n_steps=1, write_files=False, leaks={"growth_warmup_steps": 2, "estimate_model_states": False})
STEPS = 60


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 1)
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def clean(net: Net, batch: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    return net(batch).pow(2).mean()


def list_on_module(net: Net, batch: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    net.cache.append(torch.ones(128 * 1024))  # 512 KiB per step, kept on the module
    return net(batch).pow(2).mean()


def global_list(net: Net, batch: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    SEEN.append(torch.ones(128 * 1024))
    return net(batch).pow(2).mean()


def stored_loss(net: Net, batch: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    emb = torch.randn(256, 512).requires_grad_()  # seed 000: a leaf that requires grad
    loss = net(emb[:, :64]).pow(2).mean() + emb.pow(2).mean()
    state["last"] = {"loss": loss}  # kept until the next step overwrites it
    return loss


ZOO: list[tuple[str, Callable[..., torch.Tensor], str | None, tuple[str, ...]]] = [
    ("clean", clean, None, ()),
    ("list on the module", list_on_module, "growth", ("Net.cache grew by",)),
    ("module-level global", global_list, "growth", ("global SEEN grew by",)),
    ("stored loss with its graph", stored_loss, "lingering", ("state['last']['loss'] (", "-> autograd graph -> leaf tensor 256x512 float32")),
]


@pytest.fixture(autouse=True)
def isolated() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    SEEN.clear()
    gc.collect()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    SEEN.clear()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.set_num_threads(threads)


def run_plain(step_fn: Callable[..., torch.Tensor]) -> Monitor:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    monitor = Monitor(net, optimizer, **CONFIG)
    state: dict[str, Any] = {}
    for batch in monitor.track(torch.randn(32, 64) for _ in range(STEPS)):
        loss = step_fn(net, batch, state)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        del loss  # the loop keeps nothing: whatever lingers is the planted bug's
    monitor.close()
    return monitor


def run_accelerate(step_fn: Callable[..., torch.Tensor]) -> Monitor:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    net, optimizer = accelerator.prepare(net, optimizer)
    monitor = AccelerateMemoryMonitor(accelerator, **CONFIG)
    state: dict[str, Any] = {}
    for batch in monitor.track([torch.randn(32, 64) for _ in range(STEPS)]):
        loss = step_fn(net, batch, state)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        del loss  # the loop keeps nothing: whatever lingers is the planted bug's
    monitor.close()
    return monitor


@pytest.mark.parametrize("runner", [run_plain, run_accelerate], ids=["plain", "accelerate"])
@pytest.mark.parametrize(("name", "step_fn", "kind", "holder"), ZOO, ids=[z[0] for z in ZOO])
def test_zoo_in_plain_and_accelerate_loops(runner, name, step_fn, kind, holder, caplog):
    caplog.set_level(logging.WARNING, logger="memcallbacks")
    monitor = runner(step_fn)
    findings = monitor.findings
    if kind is None:
        assert [str(f) for f in findings] == []
        return
    assert [f.kind for f in findings] == [kind], [str(f) for f in findings]
    assert any(all(part in h for part in holder) for h in findings[0].holders), findings[0].holders
    new = [r for r in caplog.records if "found a memory problem" in r.getMessage()]
    assert len(new) == 1  # once per cause, not once per step
