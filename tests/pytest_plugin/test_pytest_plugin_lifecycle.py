"""The pytest plugin and the finding lifecycle (issue 24): a kept loss fails with numbers that agree and
its holder; a loop that keeps one step's output passes by default (advice) and fails with
``fail_on=("advice",)``; a queue that fills and stops passes (settled growth) unless ``fail_on`` names it."""

from __future__ import annotations

import lightning.pytorch  # noqa: F401  imported here, kept across the in-process inner runs
import pytest
import torch
import torch._dynamo  # noqa: F401  optimizer.step imports it; a second import after pytester drops it fails

from test_pytest_plugin import LIGHTNING, run

pytest_plugins = ["pytester"]


def test_a_kept_loss_fails_with_agreeing_numbers_and_its_holder(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kept=LIGHTNING + '''

class M(LitModel):
    def __init__(self):
        super().__init__()
        self.kept = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.kept.append(loss)  # BUG: every step's loss, with its graph
        return loss


@pytest.mark.train_memory
def test_kept_loss(tmp_path):
    fit(M(), tmp_path)
''')
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "grew by 0 B" not in text, text
    result.stdout.fnmatch_lines([
        "*the autograd graphs of steps * were alive together at step * (growth, graph chain)*",
        "    held by: *M.kept*",
    ])


KEEPS_OUTPUT = '''
import pytest, torch
from torch import nn


def batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 64, generator=g), torch.randn(64, 16384, generator=g)) for _ in range(n)]


def loop(train_memory):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16384))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in train_memory.track(model, optimizer, batches(8)):
        output = model(x)  # a stock loop: never deleted, rebound by the next step's forward
        loss = ((output - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.item()


def test_default(train_memory):
    train_memory.limits(max_leak="2 MiB")
    loop(train_memory)


def test_fail_on_advice(train_memory):
    train_memory.limits(max_leak="2 MiB", fail_on=("advice",))
    loop(train_memory)
'''


def test_a_lingering_output_is_advice_that_fails_only_when_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_output=KEEPS_OUTPUT)
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_output.py::test_fail_on_advice failed*", "*(lingering, advice)*"])


def test_fail_on_ini_and_a_bad_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_output=KEEPS_OUTPUT.replace('fail_on=("advice",)', ""))
    pytester.makeini("[pytest]\ntrain_memory_fail_on = advice\n")
    run(pytester).assert_outcomes(failed=2)
    pytester.makeini("[pytest]\ntrain_memory_fail_on = leaks\n")
    result = run(pytester)
    assert "train_memory_fail_on (ini)=['leaks'] has 'leaks'" in result.stderr.str() + result.stdout.str()
