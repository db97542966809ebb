"""The address-space reserve (docs/oom.md): one mapping per process, kept while any run holds it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")

SCRIPT = textwrap.dedent('''
    import resource
    from memcallbacks.oom.accounting import RESERVE_BYTES, hold_reserve, release_reserve

    def vm():
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize:"))

    print("unlimited", hold_reserve() or vm() == vm(), release_reserve())
    resource.setrlimit(resource.RLIMIT_AS, (vm() + (2 << 30), resource.RLIM_INFINITY))
    base = vm()
    hold_reserve(); first = vm() - base
    hold_reserve(); second = vm() - base    # a second monitor in the process: no second mapping
    freed_first = release_reserve()          # the first monitor stops: the second still holds it
    still = vm() - base
    freed_last = release_reserve()          # the last one stops: unmapped
    after = vm() - base
    hold_reserve()
    at_oom = release_reserve(now=True)       # an OOM's explanation: unmapped at once, whoever holds it
    print("limited", first == RESERVE_BYTES, second == RESERVE_BYTES, freed_first, still == RESERVE_BYTES, freed_last == RESERVE_BYTES,
          after, at_oom == RESERVE_BYTES, vm() - base)
''')


def test_two_monitors_share_one_reserve_until_the_last_stops() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["unlimited"] == "True 0"  # no address-space limit: nothing is mapped, nothing to give back
    assert lines["limited"] == "True True 0 True True 0 True 0", lines["limited"]
