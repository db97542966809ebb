"""Out of memory, explained: real CPU OOMs under an address-space limit, in every adapter.

Each framework's runs go through one driver process (``oom_runs.py``) that forks a child per run;
each child trains under ``RLIMIT_AS`` = the driver's address space + 500 MiB until the CPU allocator
fails (the batch doubles every step), or with the batch the explanation says fits (and one more).
The explanation is read back from the ``oom.json`` the monitor wrote in the child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memcallbacks.oom import is_oom, oom_source, requested_bytes

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")]
DRIVER = Path(__file__).with_name("oom_runs.py")
# Not less: at 250 MiB the runs took a third less time, but in 2 of 4 runs the Trainer's "one more" batch (15) failed
# in oneDNN ("could not create a primitive"), not in the CPU allocator: with small tensors its own allocations hit the limit
BUDGET_MIB = 500
MODULE_TYPES = {"Linear", "GELU", "Block", "Attention", "Layer", "LayerNorm", "Sequential"}
PROCESS = "the process (interpreter, libraries, allocator's free lists, thread stacks)"


def drive(framework: str, tmp_path: Path, *runs: str) -> list[dict[str, Any]]:
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg", WANDB_MODE="offline", WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, str(DRIVER), framework, str(BUDGET_MIB), str(out), *runs], env=env, capture_output=True,
                          text=True, timeout=600)
    assert out.is_file(), done.stderr[-3000:]
    results = json.loads(out.read_text())
    crashed = [(r["run"], r["crashed"]) for r in results if r.get("crashed")]  # a child that died without writing its result
    assert not crashed, (crashed, done.stderr[-3000:])
    return results


def check_explained(result: dict[str, Any]) -> dict[str, Any]:
    """Recognised, the error unchanged, the phase and module named, the categories adding up to the figure that hit the limit."""
    assert result["completed"] is False and result["error_type"] == "RuntimeError", result
    assert "DefaultCPUAllocator: can't allocate memory" in result["error"]  # propagated unchanged
    oom = result["oom"]
    assert oom is not None, result.get("trace")
    assert oom["source"] == "cpu" and oom["error"].startswith("RuntimeError: [enforce fail")
    where = oom["where"]
    assert where["phase"] in ("forward", "backward"), where
    if where["phase"] == "forward":  # the innermost module running, by its name in the model
        assert where["module"] and where["module_type"] in MODULE_TYPES, where
    else:  # backward runs in the C++ engine: the modules with the largest saved activations are named instead
        assert oom["predicted"]["top_modules"], oom["text"]
    memory = oom["memory"]
    cats, figure, limit, request = memory["categories"], memory["figure_bytes"], result["limit"], memory["requested_bytes"]
    assert memory["capacity_bytes"] == limit and memory["capacity_source"] == "RLIMIT_AS"
    assert sum(cats.values()) == figure
    assert 0 < request and figure <= limit  # read while the error unwinds: a framework may free some memory first
    # each category from its own source, and the process's own address space measured at its first forward (every
    # framework object, thread and import there, less the parameters and batch then alive): within 5% of the figure
    first = result["first_forward"]
    independent = sum(v for k, v in cats.items() if k != PROCESS) + first["vm"] - first["tensors"]
    assert abs(independent - figure) <= 0.05 * figure, (independent, figure, oom["text"])
    # AdamW: exp_avg and exp_avg_sq, and one 8-byte step count per parameter tensor
    assert cats["parameters"] > 0 and 0 <= cats["optimizer state"] - 2 * cats["parameters"] <= 1024
    return oom


def check_fits(results: list[dict[str, Any]], model: str) -> None:
    """The batch the explanation says fits completes under the same limit; one more fails."""
    grow = next(r for r in results if r["model"] == model and r["run"] == "grow")
    remedy = next((r for r in grow["oom"]["remedies"] if r["kind"] == "batch_size"), None)
    assert remedy is not None, grow["oom"]["text"]
    n = remedy["details"]["batch_size"]
    assert 1 <= n < remedy["details"]["failed_batch_size"] and remedy["fits"] is True
    fits = next(r for r in results if r["model"] == model and r["run"] == f"fixed:{n}")
    above = next(r for r in results if r["model"] == model and r["run"] == f"fixed:{n + 1}")
    assert fits["completed"] is True and fits["steps"] == 2, fits.get("error")
    if above["completed"]:  # on the safe side by one size: glibc's kept memory moves the address space by a few MiB
        above = next(r for r in results if r["model"] == model and r["run"] == f"fixed:{n + 2}")
    assert above["completed"] is False and "can't allocate memory" in above["error"], above
    assert fits["limit"] == grow["limit"] == above["limit"]


def test_plain_monitor(tmp_path: Path) -> None:
    # the savings are measured last, in the driver itself: a run forked after them inherits the heap they grew (VmSize
    # 1.1 GiB at the fork, 0.8 GiB at the first forward once trimmed), and a transformer's share of the process then
    # grew by ~235 MiB while its step ran, beyond the 5% (docs/oom.md, "Limits"); the transformer has its test below
    results = drive("plain", tmp_path, "mlp/grow", "mlp/fits", "mlp/savings")
    oom = check_explained(results[0])
    check_fits(results, "mlp")
    kinds = [r["kind"] for r in oom["remedies"]]
    assert {"batch_size", "checkpointing", "optimizer", "precision"} <= set(kinds)
    savings = [r["saving_bytes"] for r in oom["remedies"] if r["saving_bytes"] is not None]
    assert savings == sorted(savings, reverse=True)  # largest predicted saving first
    assert "leak" not in kinds  # the floor did not rise: the batch did
    # predicted savings against a real re-run of the failed step with each change (no limit): within 10%
    measured = next(r for r in results if r["run"] == "savings")
    for kind in ("checkpointing", "optimizer"):
        predicted = next(r["saving_bytes"] for r in oom["remedies"] if r["kind"] == kind)
        assert abs(predicted - measured[kind]) <= 0.10 * measured[kind], (kind, predicted, measured)
    # the run's files: report.json has the event with the explanation and the "oom" finding; oom.json is linked
    assert [f["kind"] for f in results[0]["findings"]] == ["oom"]
    report = subprocess.run([sys.executable, "-m", "memcallbacks", "report", results[0]["output_dir"]], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])), timeout=120)
    assert "  out of memory, explained (" in report.stdout and "what makes it fit" in report.stdout, report.stdout + report.stderr
    assert oom["text"].startswith(f"out of memory at step {oom['step']} on rank 0, in {oom['where']['phase']}")


def test_plain_monitor_transformer(tmp_path: Path) -> None:
    results = drive("plain", tmp_path, "transformer/grow", "transformer/fits")
    check_explained(results[0])
    check_fits(results, "transformer")


@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_adapters(framework: str, tmp_path: Path) -> None:
    # both models under every adapter: the explanation, and the batch it says fits re-run under the same limit
    results = drive(framework, tmp_path, "mlp/grow", "mlp/fits", "transformer/grow", "transformer/fits")
    for model in ("mlp", "transformer"):
        check_explained(next(r for r in results if r["model"] == model and r["run"] == "grow"))
        check_fits(results, model)


def test_leak_is_the_cause_not_the_batch(tmp_path: Path) -> None:
    (result,) = drive("plain", tmp_path, "mlp/leak")
    assert result["completed"] is False and 25 <= result["oom"]["step"] <= 60, result["oom"]["step"]
    oom = result["oom"]
    first = oom["remedies"][0]
    assert first["kind"] == "leak", oom["text"]
    assert any("Net.kept" in h for h in first["details"]["holders"]), first
    held = oom["memory"]["categories"]["held from earlier steps"]
    assert held >= 0.8 * (oom["step"] - 3) * (11 << 20)  # 11 MiB kept a step since the first steps
    kinds = [r["kind"] for r in oom["remedies"]]
    assert "batch_size" not in kinds[: kinds.index("leak") + 1]
    # the step is replayed on fake tensors, the leak's kept tensors included (none copied for real: tests/preflight),
    # in the room the monitor's address-space reserve leaves when it is released (when memory ran out in backward, the
    # failed step's activations are still held: without it, the replay's own objects did not fit, 1 run in 2 of the suite)
    assert "preflight" not in kinds and "checkpointing" in kinds, oom["text"]
    assert "address-space reserve" in oom["text"], oom["text"]
    last = oom["last_good_step"]  # the last row with peaks (not an open row without any)
    assert last["step"] <= oom["step"] and last["peaks"], last


# ---------------------------------------------------------------------- recognising, without running out
def test_every_allocator_recognised() -> None:
    import torch

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
                       "allocate 134217728 bytes. Error code 12 (Cannot allocate memory)")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB")
    mps = RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB, max allowed: 18.13 GB). "
                       "Tried to allocate 256.00 MiB on private pool.")
    assert [oom_source(e) for e in (cpu, cuda, mps, MemoryError())] == ["cpu", "cuda", "mps", "host"]
    assert requested_bytes(cpu) == 134217728 and requested_bytes(cuda) == 20 << 20 and requested_bytes(mps) == 256 << 20
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
