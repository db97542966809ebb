"""The host channel on a device run: a CPU-side leak found while device memory stays flat.

    python scripts/host_channel_check.py [--device cuda|cpu] [--steps 80]

A plain ``Monitor`` at its defaults watches a small model training on ``--device`` (default:
``cuda`` when available). From step 10 each step adds 512 dataclass objects (~250 KiB, no
tensors) to a module-level dict, the issue-23 leak. The check passes (exit 0) when:

- a ``host_growth`` finding is raised within 40 steps of the leak's start, naming the type
  (``Spec``) and the holder (``cache``);
- on a CUDA run, no device ``growth`` finding is raised (device memory is flat: the leak is on
  the host only, and it must not be reported as a device leak).

Run by ``scripts/gpu_check.sh`` (stage ``host_channel``); ``tests/host/test_host_channel_check.py``
runs it on CPU so the script itself is kept working without a GPU. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

LEAK_START = 10
WITHIN = 40


@dataclass
class Spec:
    name: str
    shape: tuple
    stride: tuple
    placement: list
    step: int


cache: dict = {}  # the leak's holder: module __main__, global cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("host_channel_check: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    from memcallbacks import Monitor

    device = torch.device(args.device)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    monitor = Monitor(net, opt, device=args.device)
    data = (torch.randn(64, 256, device=device) for _ in range(args.steps))
    for step, batch in enumerate(monitor.track(data)):
        loss = net(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        del loss
        if step >= LEAK_START:
            for i in range(512):
                cache[(step, i)] = Spec(f"p{step}.{i}", (step, i, 3), (1, step, i), [step, i], step)
    monitor.close()
    findings = [f.to_dict() for f in monitor.findings]
    host = [f for f in findings if f.get("kind") == "host_growth"]
    device_growth = [f for f in findings if f.get("kind") == "growth"]
    problems = []
    if not host:
        problems.append("no host_growth finding")
    else:
        first = host[0]
        if first["first_step"] > LEAK_START + WITHIN:
            problems.append(f"host_growth first raised at step {first['first_step']}, later than {LEAK_START + WITHIN}")
        text = json.dumps(first)
        for needle in ("Spec", "cache"):
            if needle not in text:
                problems.append(f"the host_growth finding does not name {needle!r}")
    if device.type == "cuda" and device_growth:
        problems.append(f"a device growth finding on a host-only leak: {device_growth[0].get('message', '')[:200]}")
    print(json.dumps({"device": str(device), "host_growth_first_step": host[0]["first_step"] if host else None,
                      "device_growth": len(device_growth), "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
