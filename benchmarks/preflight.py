"""Pre-flight accuracy and speed: predicted vs measured per-phase peaks on CPU, and a 1B-param meta model.

    python benchmarks/preflight.py            # the table in docs/preflight.md
    python benchmarks/preflight.py --scale 1  # the sizes tests/preflight/test_preflight.py uses
    python benchmarks/preflight.py --device cuda --quick --json preflight_cuda.json   # scripts/gpu_check.sh

On CUDA the ground truth is ``torch.cuda.max_memory_allocated`` per phase of the real steady-state
step (the peak counter reset between phases), against ``predict(..., device="cuda")``; without a
GPU ``--device cuda`` prints that none is present and exits 0.

Ground truth is the same real step's exact allocated bytes from ``torch.profiler`` memory events
(:func:`memcallbacks.preflight.measure_step`); the ratio is predicted / measured. The MemTracker
column is torch's ``torch.distributed._tools.mem_tracker.MemTracker`` run on the same fake step
(its overall peak only: it has no per-phase peaks), for comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=2, help="model/batch size multiplier (tests use 1)")
    parser.add_argument("--skip-1b", action="store_true", help="skip the 1B-parameter speed check")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: against torch.profiler's exact bytes; cuda: against torch.cuda.max_memory_allocated per phase")
    parser.add_argument("--quick", action="store_true", help="one size (scale 1 on CPU, 4 on CUDA), no 1B check")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help and argument errors answer here, before torch loads (seconds)
    ARGS = parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo tests share

from _common import ResultFile  # noqa: E402  (this file's folder is sys.path[0])
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


PHASES = ("forward", "backward", "optimizer")


def _to(value: object, device: str) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def measure_cuda_step(case: Case, batch: object) -> dict[str, int]:
    """One warm-up step, then the steady-state step's ``max_memory_allocated`` per phase (reset between phases)."""
    autocast = torch.autocast("cuda", dtype=case.autocast_dtype, enabled=case.autocast_dtype is not None)
    phases: dict[str, int] = {}
    for step in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with autocast:
            loss = case.forward_fn(case.model, batch)
        torch.cuda.synchronize()
        phases["forward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        phases["backward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        case.optimizer.step()
        case.optimizer.zero_grad(set_to_none=True)
        del loss
        torch.cuda.synchronize()
        phases["optimizer"] = torch.cuda.max_memory_allocated()
    return phases


def cuda_table(scale: int, on_row: Callable[[dict[str, object]], None] = lambda row: None) -> dict[str, object]:
    """Predicted (``device="cuda"``) against measured ``max_memory_allocated`` per phase, per zoo model;
    ``on_row(row)`` after each model (the JSON is rewritten then: a stage timeout keeps the rows so far)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    rows = []
    print("| model | predicted fwd / bwd / opt (MiB) | measured fwd / bwd / opt (MiB) | ratio fwd | bwd | opt |\n|---|---|---|---:|---:|---:|")
    for key, build in CASES.items():
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        case = build(scale)
        case.model.to("cuda")  # in place: the optimizer keeps its parameters
        batch = _to(case.batch, "cuda")
        try:
            p = predict(case.model, batch, case.optimizer, forward_fn=case.forward_fn, precision=case.precision, device="cuda", hopper=hopper)
            measured = measure_cuda_step(case, batch)
        except Exception as exc:  # one model failing must not hide the others
            rows.append({"model": case.name, "error": f"{type(exc).__name__}: {exc}"})
            on_row(rows[-1])
            print(f"| {case.name} | failed: {type(exc).__name__}: {exc} |")
            continue
        predicted = p.phase_peaks()
        ratio = {ph: predicted[ph] / measured[ph] for ph in PHASES}
        rows.append({"model": case.name, "scale": scale, "precision": case.precision, "allocated_before_case_bytes": before,
                     "predicted_bytes": predicted, "measured_bytes": measured, "ratio": ratio, "notes": list(p.notes)})
        on_row(rows[-1])
        mib = lambda d: " / ".join(f"{d[ph] / 2**20:.2f}" for ph in PHASES)  # noqa: E731
        print(f"| {case.name} | {mib(predicted)} | {mib(measured)} | " + " | ".join(f"{ratio[ph]:.4f}" for ph in PHASES) + " |", flush=True)
        del case, batch, p
    errors = [abs(r - 1) for row in rows for r in row.get("ratio", {}).values()]
    worst = max(errors) if errors else None
    print(f"\nworst phase error: {worst * 100:.2f}% (target 10%)" if worst is not None else "\nno model measured")
    return {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()), "hopper": hopper,
            "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows, "worst_phase_error": worst}


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


def main(argv: list[str] | argparse.Namespace | None = None) -> None:
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("benchmarks/preflight.py --device cuda: no GPU is present (torch.cuda.is_available() is False); nothing measured.")
            if args.json:
                Path(args.json).write_text(json.dumps({"device": "cuda", "skipped": "no GPU present"}, indent=2))
            return
        results = ResultFile(args.json, device="cuda", scale=4 if args.quick else args.scale)
        result = cuda_table(4 if args.quick else args.scale, on_row=lambda row: results.append("rows", row))
        results.finish(**result)
        return
    torch.set_num_threads(2)
    scale = 1 if args.quick else args.scale
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, scale {scale}\n")
    rows = accuracy_table(scale)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": "cpu", "scale": scale, "table": rows}, indent=2))
    if not (args.skip_1b or args.quick):
        print("\n" + one_billion())


if __name__ == "__main__":
    main(ARGS)
