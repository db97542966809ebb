"""The pytest plugin: a ``train_memory`` test that runs out of memory fails with the explanation as its message."""

from __future__ import annotations

import re
import sys

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import resource, torch
from torch import nn

def vm_size():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))

@pytest.mark.train_memory(max_leak="1 GiB")
def test_growing_batch(train_memory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    limit = vm_size() + (400 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        for x in train_memory.track(model, optimizer, (torch.randn(n, 256, 256) for n in (4, 8, 16, 32, 64, 128, 256))):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:  # the frames stay alive with the error; the report needs room to be written
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_oom_fails_with_its_error_and_the_explanation(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_oom="import pytest\n" + INNER)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-W", "ignore")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    # the test's own error, with its traceback, then the explanation in a section of its own
    assert re.search(r"^E +RuntimeError: \[enforce fail at alloc_cpu.cpp", text, re.M), text[-3000:]
    section = text.index("memcallbacks: out of memory, explained")
    # the 400 MiB of address space run out at batch 128's forward or backward (step 5), or at batch 64's backward
    # (step 4) when glibc keeps more of the earlier steps' freed memory: where, the step and the phase are named
    assert re.search(r"out of memory at step [45] on rank 0, in (forward|backward)", text[section:]), text[section:]
    assert "what filled it:" in text and "activations and temporaries" in text
    # with the loop's model and optimizer: its monitor stays open until the plugin has recorded the error
    assert re.search(r"\d+\.\d MiB  parameters", text) and re.search(r"\d+\.\d MiB  optimizer state", text), text
    assert "saves 0 B" not in text and "written to " in text[section:], text
