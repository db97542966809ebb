"""Pre-flight accuracy and speed: predicted vs measured per-phase peaks on CPU, and a 1B-param meta model.

    python benchmarks/preflight.py            # the table in docs/preflight.md
    python benchmarks/preflight.py --scale 1  # the sizes tests/test_preflight.py uses

Ground truth is the same real step's exact allocated bytes from ``torch.profiler`` memory events
(:func:`memcallbacks.preflight.measure_step`); the ratio is predicted / measured. The MemTracker
column is torch's ``torch.distributed._tools.mem_tracker.MemTracker`` run on the same fake step
(its overall peak only: it has no per-phase peaks), for comparison.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo tests share

from preflight_zoo import CASES, Case  # noqa: E402

from memcallbacks.preflight import measure_step, predict  # noqa: E402


def memtracker_peak(case: Case) -> int | None:
    """torch's MemTracker on the same fake steady-state step (None if it fails)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from memcallbacks.preflight._fake import fake_batch, fake_model, fake_optimizer

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.random.fork_rng(devices=[]):
            model, params = fake_model(case.model, mode, torch.device("cpu"), None)
            opt = fake_optimizer(case.optimizer, params, list(model.parameters()), foreach=None)
            batch = fake_batch(case.batch, mode, torch.device("cpu"), None)
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with mode, tracker:
                for i in range(2):
                    if i == 1:
                        tracker.reset_mod_stats()
                    ctx = torch.autocast("cpu", dtype=case.autocast_dtype) if case.autocast_dtype else torch.autocast("cpu", enabled=False)
                    with ctx:
                        loss = case.forward_fn(model, batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    del loss
            peak = tracker.get_tracker_snapshot("peak")
        return int(sum(v.get("Total", 0) for v in peak.values()))
    except Exception as exc:  # a comparison column only
        print(f"  MemTracker failed on {case.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def accuracy_table(scale: int) -> list[str]:
    rows = ["| model | params | phase peaks measured (MiB) fwd / bwd / opt | predicted / measured fwd | bwd | opt | MemTracker peak / measured | predict s |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    print("\n".join(rows), flush=True)
    worst = 0.0
    for key, build in CASES.items():
        torch.manual_seed(0)
        case = build(scale)
        t = time.perf_counter()
        p = predict(case.model, case.batch, case.optimizer, forward_fn=case.forward_fn, precision=case.precision)
        seconds = time.perf_counter() - t
        mt = memtracker_peak(case)
        m = measure_step(case.model, case.batch, case.optimizer, case.forward_fn, autocast_dtype=case.autocast_dtype)
        peaks = p.phase_peaks()
        ratios = [peaks[ph] / m[ph] for ph in ("forward", "backward", "optimizer")]
        worst = max(worst, *(abs(r - 1) for r in ratios))
        mib = " / ".join(f"{m[ph] / 2**20:.2f}" for ph in ("forward", "backward", "optimizer"))
        n = sum(q.numel() for q in case.model.parameters())
        mt_cell = f"{mt / max(m['forward'], m['backward'], m['optimizer']):.3f}" if mt else "failed"
        rows.append(f"| {case.name} | {n / 1e6:.2f}M | {mib} | " + " | ".join(f"{r:.4f}" for r in ratios)
                    + f" | {mt_cell} | {seconds:.2f} |")
        print(rows[-1], flush=True)
    rows.append(f"\nworst phase error: {worst * 100:.2f}% (target 5%)")
    print(rows[-1])
    return rows


def one_billion() -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=20, n_embd=2048, n_head=16, vocab_size=50257, n_positions=1024)
    t = time.perf_counter()
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.empty(4, 1024, dtype=torch.long, device="meta")
    p = predict(model, {"input_ids": ids, "labels": ids}, "adamw", precision="bf16-mixed", device="cuda")
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = sum(q.numel() for q in model.parameters())
    return (f"1B meta-built GPT-2 ({n / 1e9:.2f}B params, batch 4 x 1024, bf16-mixed, AdamW, cuda target): "
            f"built and predicted in {seconds:.1f} s, peak RSS {rss:.0f} MiB, predicted peak "
            f"{p.peak_bytes / 2**30:.2f} GiB in {p.peak_phase}\n\n{p}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=2, help="model/batch size multiplier (tests use 1)")
    parser.add_argument("--skip-1b", action="store_true", help="skip the 1B-parameter speed check")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, scale {args.scale}\n")
    accuracy_table(args.scale)
    if not args.skip_1b:
        print("\n" + one_billion())


if __name__ == "__main__":
    main()
