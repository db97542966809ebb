"""What one phase boundary costs on CUDA: the stats read (C binding vs public API) and the peak reset.

    python benchmarks/cuda_boundary.py [--json PATH]

Each CUDA boundary reads the caching allocator's statistics (``torch._C._cuda_memoryStats``, which
builds dozens of nested dicts) and resets its peaks. This times both, and the public
``torch.cuda.memory_stats`` (which also flattens), per call, after a real training step has
populated the allocator. Needs a GPU; exits 0 with a note without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _per_call_us(fn, calls: int = 2000, repeats: int = 5) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch  # here, not above: --help and argument errors answer before torch loads (seconds)

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from memcallbacks._base import torch_private
    from memcallbacks._base.devices import CudaBackend

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):  # a populated allocator: many blocks, several segments
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    backend = CudaBackend(torch.device("cuda", 0))
    read = torch_private.cuda_stats_reader(0)
    reset = torch_private.cuda_peak_resetter(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "c_binding_read": _per_call_us(read),
        "public_memory_stats": _per_call_us(lambda: torch.cuda.memory_stats(0)),
        "peak_reset": _per_call_us(reset),
        "backend_interval": _per_call_us(backend.interval),
        "backend_baseline": _per_call_us(backend.baseline),
    }
    for key, value in result.items():
        text = value if isinstance(value, str) else "%.2f µs/call (min %.2f)" % (value["median_us"], value["min_us"])
        print(f"{key:>22}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
