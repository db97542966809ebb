"""The pytest plugin on host growth (issue 23): a Python-object leak in a training step, with no
tensors, fails a ``train_memory`` test naming the holder and the type; ``max_leak`` bounds it as it
bounds a tensor leak; a clean loop passes; a cache that fills and then stops is settled growth,
which passes unless ``fail_on=("settled",)``.

Real inner test files through ``pytester.runpytest_subprocess``: each inner session is a process of
its own, as every host-channel test runs (tests/host/test_host_monitor.py)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# sympy (and mpmath) are imported up front: torch imports them lazily, and when that happens between the
# plugin's two host censuses (seen under load) thousands of new modules, functions and types outgrow the
# planted leak in the census diff (a known weakness, in the session note: imports are not told apart)
LOOP = '''
import pytest, torch
import sympy  # noqa: F401  - see the comment above LOOP
from dataclasses import dataclass
from torch import nn


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


SPECS = {}


def loop(train_memory, steps, per_step):
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(train_memory.track(model, optimizer, [(x, x[:, :1])] * steps)):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for i in range(per_step(step)):  # no tensors: spec-like objects kept in a module-level dict
            SPECS[(id(train_memory), step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)
'''


def run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_host=LOOP + source)
    return pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-W", "ignore", "--strict-markers",
                                         timeout=400)


def failed_tests(result: pytest.RunResult) -> list[str]:
    return sorted(line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED "))


def test_python_object_leak_fails_naming_holder_and_type_max_leak_bounds_it_and_a_clean_loop_passes(pytester: pytest.Pytester) -> None:
    result = run(pytester, '''

def test_leaky(train_memory):
    loop(train_memory, 64, lambda step: 512)   # ~250 KiB of Python objects a step


@pytest.mark.train_memory(max_leak="256 MiB")
def test_leaky_within_max_leak(train_memory):
    loop(train_memory, 64, lambda step: 512)


def test_clean(train_memory):
    loop(train_memory, 64, lambda step: 0)
''')
    assert failed_tests(result) == ["test_leaky"], result.stdout.str()[-6000:]
    result.stdout.fnmatch_lines([
        "train_memory: test_host.py::test_leaky failed 1 memory check",  # one leak, one failure (no device growth beside it)
        "Python objects on the host grew by * MiB from step * to step *, */step (host growth): *Spec +*",
        "    held by: module test_host: global SPECS (dict) grew by * Spec objects / * MiB",
        "    fix: Something keeps Python objects from every step*",
    ])
    text = result.stdout.str()
    assert "(cycle)" not in text  # the host censuses leave no cyclic garbage of their own


def test_host_growth_that_settles_passes_by_default_and_fails_with_fail_on_settled(pytester: pytest.Pytester) -> None:
    result = run(pytester, '''

def test_cache_fills_then_stops(train_memory):
    loop(train_memory, 180, lambda step: 512 if step < 50 else 0)


@pytest.mark.train_memory(fail_on=("settled",))
def test_cache_fills_then_stops_fail_on_settled(train_memory):
    loop(train_memory, 180, lambda step: 512 if step < 50 else 0)
''')
    assert failed_tests(result) == ["test_cache_fills_then_stops_fail_on_settled"], result.stdout.str()[-6000:]
    result.stdout.fnmatch_lines([
        "train_memory: test_host.py::test_cache_fills_then_stops_fail_on_settled failed 1 memory check",
        "Python objects on the host grew by * (host growth, settled)*",
        "    held by: module test_host: global SPECS (dict) grew by * Spec objects / * MiB",
        "    fix: Settled: host memory grew from step * then stayed flat for * steps*",
    ])
