"""A small CPU training loop with a host-side (Python-object) leak or a warm-up-then-flat cache,
watched by the host channel's reader and growth test; prints one JSON line.

    python tests/scripts/host_leak.py SCENARIO STEPS

SCENARIO: ``spec:N`` (N dataclass objects a step into a module-level dict), ``floats:N`` (a dict
of N per-parameter floats a step appended to a list), ``warm`` (a bounded ``lru_cache``, a
``deque(maxlen=...)`` and a log history trimmed to a bounded size, filling for ~60 steps, then
flat), ``fill`` (a bounded ``lru_cache`` filling at ~250 KiB/step from step 10 to 70, then full),
``none``. A process of its own: in a long-lived process (a test session) freed heap is
refilled by a leak before the resident set moves, which would make latencies depend on the tests
that ran before.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
from dataclasses import dataclass

import torch

from memcallbacks.host import HostGrowth, HostReader


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


CACHE: dict = {}
RECORDS: list = []
HISTORY: list = []
RECENT: collections.deque = collections.deque(maxlen=3000)


@functools.lru_cache(maxsize=3000)
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def leak_specs(n: int):
    def leak(step: int) -> None:
        for i in range(n):
            CACHE[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)
    return leak


def leak_floats(n: int):
    def leak(step: int) -> None:
        RECORDS.append({f"layer{i}.weight": float(step * i) + 0.5 for i in range(n)})
    return leak


@functools.lru_cache(maxsize=512 * 60)
def describe(key: tuple) -> Spec:
    return Spec(f"p{key[0]}.{key[1]}", key, (1,) + key, list(key), key[0])


def fill(step: int) -> None:
    """A bounded memo cache that fills at ~250 KiB/step for 60 steps after warm-up, then stops."""
    for i in range(512 if 10 <= step < 70 else 0):
        describe((step, i))


def warm(step: int) -> None:
    for i in range(50):
        tokenize(f"word-{step}-{i}-" + "x" * 40)  # 3000 entries: full after 60 steps
    for i in range(50):
        RECENT.append({"step": step, "loss": float(i), "tag": f"t{step}.{i}"})
    HISTORY.append({"loss": 1.0 / (step + 1), "step": step, "lr": 1e-3, "note": f"step {step}"})
    if len(HISTORY) > 60:  # a log history of bounded size, like a trimmed Trainer log
        del HISTORY[:10]


def main() -> None:
    scenario, steps = sys.argv[1], int(sys.argv[2])
    name, _, arg = scenario.partition(":")
    work = {"spec": lambda: leak_specs(int(arg)), "floats": lambda: leak_floats(int(arg)), "warm": lambda: warm, "fill": lambda: fill,
            "none": lambda: (lambda step: None)}[name]()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    reader, growth = HostReader(), HostGrowth()
    found = None
    events = []
    for step in range(steps):
        finding = growth.update(reader.read(step))
        if finding is not None:
            events.append({"step": step, "key": finding.key, "open": finding.details.get("open")})
            if found is None and finding.details.get("open"):
                found = step
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        work(step)
    print(json.dumps({
        "found": found,
        "events": events[:5] + [e for e in events if e["open"] is False],  # the first confirmations, and settlements
        "open": [f.key for f in growth.open_findings],
        "findings": {k: f.to_dict() for k, f in growth.findings.items()},
        "read_seconds": reader.seconds,
        "reads": reader.calls,
        "blocks_every": reader.blocks_every,
        "figures": growth.figures(),
    }))


if __name__ == "__main__":
    main()
