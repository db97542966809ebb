"""Issue 14, item 5: the monitor's live theory check under real sharding, 2 CPU ranks with gloo.

Each case runs ``tests/scripts/sharded_fit.py`` (a residual MLP of 4 blocks, 9.4 M parameters, Adam)
as two processes, FSDP2 (``fully_shard`` per block and on the root) or DDP, in a plain loop under
``Monitor`` or fitted by Lightning under ``MemoryMonitor`` (``ModelParallelStrategy`` whose
``configure_model`` calls ``fully_shard``, or ``DDPStrategy``). Every rank writes ``rank{R}.json``:
what ``measure_model_states`` counts on that rank (DTensor local shards, their grads, optimizer
state) and the monitor's ``model_states`` (``report.json``). The tests check, per rank:

- the monitor's expected params / grads / optimizer state match what the rank measures (within 2%;
  in fact byte for byte) and a per-rank count from the global shapes alone (FSDP2 dim-0 chunks,
  parameters and grads padded to the first chunk, optimizer state over the rank's own rows);
- ``unexplained`` (the rank's heap at step 1 against that theory plus the batch) is within 2% of the
  expected model states: the allocator agrees with the theory, DDP's hidden gradient buckets included.

The script warms the BLAS library up before the monitor starts (see ``warm_up_blas`` and
docs/theory.md, "Measured under real sharding"): the first matmul of a process keeps a 4.5-10 MiB
workspace, which would be unexplained on the CPU heap whatever the strategy.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import MIB, free_port, run_as_shown, trainer_kwargs
from memcallbacks import MemoryMonitor

ROOT = Path(__file__).parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
WORLD_SIZE = 2
TOLERANCE = 0.02  # the bound for model states
FP32 = 4


#: docs/theory.md shows this command; it runs here, as shown (tests/docs/test_docs_commands.py leaves it to this test)
DOCUMENTED = "python tests/scripts/sharded_fit.py /tmp/sharded --runner lightning --strategy fsdp2"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    return env


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def run_sharded(out: Path, runner: str, strategy: str, *extra: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(SCRIPTS / "sharded_fit.py"), str(out), "--runner", runner, "--strategy", strategy, "--port", str(free_port()), *extra]
    proc = subprocess.run(cmd, cwd=str(out), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return _records(out)


def run_documented() -> tuple[Path, list[dict[str, Any]]]:
    """The documented command, exactly as docs/theory.md shows it, from the project root with this environment's python."""
    assert DOCUMENTED in (ROOT / "docs" / "theory.md").read_text(), "docs/theory.md no longer shows DOCUMENTED: update both"
    out = Path(shlex.split(DOCUMENTED)[2])
    shutil.rmtree(out, ignore_errors=True)
    run_as_shown(DOCUMENTED, ROOT, env=_env())
    return out, _records(out)


def theory_per_rank(record: dict[str, Any]) -> dict[str, int]:
    """Bytes of params and Adam state on this rank from the global shapes alone (no memcallbacks)."""
    rank, params, owned_elems, tensors = record["rank"], 0, 0, 0
    for shape in record["model"]["param_shapes"].values():
        rest = math.prod(shape[1:])
        if record["strategy"] == "fsdp2":
            chunk = -(-shape[0] // WORLD_SIZE)  # torch.chunk on dim 0
            owned = max(0, min(chunk, shape[0] - rank * chunk))
            params += chunk * rest * FP32  # the local shard is padded to the first chunk
            owned_elems += owned * rest
        else:
            params += shape[0] * rest * FP32
            owned_elems += shape[0] * rest
        tensors += 1
    # Adam: exp_avg and exp_avg_sq over the rank's own elements, one 4-byte step per parameter
    return {"params": params, "grads": params, "optimizer": 2 * owned_elems * FP32 + tensors * 4}


def within(value: float, reference: float, tolerance: float = TOLERANCE) -> bool:
    return abs(value - reference) <= tolerance * reference


def check_rank(record: dict[str, Any], strategy: str, precision: str) -> dict[str, Any]:
    states = record["monitor"]
    assert (states["strategy"], states["world_size"], states["step"]) == (strategy, WORLD_SIZE, 1), states
    assert states["precision"] == precision
    expected, at_check, measured = states["expected"], states["measured_model_states"], record["measured"]
    theory = theory_per_rank(record)
    for kind in ("params", "grads", "optimizer"):
        assert within(expected[kind], theory[kind]), (kind, expected[kind], theory[kind])
    # what the rank holds at the check (step 1 start) and after training: the same params and state
    for kind in ("params", "optimizer"):
        assert within(expected[kind], at_check[kind]), (kind, expected[kind], at_check[kind])
        assert at_check[kind] == measured[kind], kind
    # grads: alive between steps (Lightning zeroes them before backward) or None (the plain loop after step)
    buckets = expected["comm_buffers"]
    assert buckets == (theory["grads"] if strategy == "ddp" else 0)  # DDP's reducer buckets
    if at_check["grads"]:
        assert within(expected["grads"], at_check["grads"])
        steady = expected["params"] + expected["grads"] + expected["optimizer"] + buckets
    else:
        steady = expected["params"] + expected["optimizer"] + buckets
    assert states["expected_steady_bytes"] == steady
    # the rank's heap agrees: what theory and the batch do not explain is under 2% of the model states
    assert abs(states["unexplained_bytes"]) <= TOLERANCE * steady, (states["unexplained_bytes"], steady)
    return states


def check_sharded(records: list[dict[str, Any]]) -> None:
    """FSDP2: each rank really holds a shard, and the two shards cover every row."""
    for name, shape in records[0]["model"]["param_shapes"].items():
        rows = [r["local_shards"][name][0] for r in records]
        assert sum(rows) == shape[0] and rows[0] == -(-shape[0] // WORLD_SIZE), (name, rows, shape)
    full = records[0]["model"]["num_params"] * FP32
    for r in records:
        assert within(r["measured"]["params"], full / WORLD_SIZE, 0.01)


CASES = [
    pytest.param("plain", "fsdp2", id="plain-fsdp2"),
    pytest.param("lightning", "fsdp2", id="lightning-fsdp2"),
    pytest.param("plain", "ddp", id="plain-ddp"),
    pytest.param("lightning", "ddp", id="lightning-ddp"),
]


@pytest.mark.slow
@pytest.mark.parametrize("runner, strategy", CASES)
def test_theory_check_agrees_with_each_rank(tmp_path, runner, strategy):
    if (runner, strategy) == ("lightning", "fsdp2"):
        tmp_path, records = run_documented()
    else:
        records = run_sharded(tmp_path, runner, strategy)
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"], record["warmup"]) == (rank, WORLD_SIZE, True)
        states = check_rank(record, strategy, "fp32")
        # the same numbers are in the rank's report.json
        report = json.loads((tmp_path / "mem" / f"report.rank{rank}.json").read_text())
        assert report["model_states"] == states
        assert report["findings"] == [], report["findings"]
    if strategy == "fsdp2":
        check_sharded(records)
        # optimizer state follows the rank's own rows: rank 1 owns fewer of the odd-sized head
        assert records[0]["measured"]["optimizer"] > records[1]["measured"]["optimizer"]
    else:
        assert records[0]["measured"] == records[1]["measured"]


@pytest.mark.slow
def test_fsdp2_mixed_precision_policy_is_bf16_mixed(tmp_path):
    """``MixedPrecisionPolicy(param_dtype=bf16)``: the sharded params, grads and Adam state stay fp32
    (what the check expects), and the estimate reads the policy: precision "bf16-mixed", not "fp32"."""
    records = run_sharded(tmp_path, "plain", "fsdp2", "--mp", "bf16")
    for record in records:
        assert record["mixed_precision"] == "bf16"
        check_rank(record, "fsdp2", "bf16-mixed")
    check_sharded(records)


# ---------------------------------------------------------------------- one process: where the reference is taken
class BuiltInConfigureModel(L.LightningModule):
    """Its 16 MiB of weights are built in ``configure_model``, after the monitor's ``setup``: what
    ``ModelParallelStrategy`` (``fully_shard``) and DDP's wrapping do to the model size in between."""

    def __init__(self) -> None:
        super().__init__()
        self.body: nn.Module | None = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.body(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.usefixtures("one_thread")
def test_model_built_after_setup_is_not_unexplained(tmp_path):
    """The CPU check compares heap growth since the model states were first measured (train start),
    not since the monitor started: a model built or sharded in between is not 'unexplained'."""
    warm = BuiltInConfigureModel()
    warm.configure_model()
    warm.training_step(torch.randn(8, 2048), 0).backward()  # the BLAS workspace, before the monitor
    del warm
    monitor = MemoryMonitor(sample_every_n_steps=1, log_every_n_steps=1, write_files=False)
    trainer = L.Trainer(**trainer_kwargs(tmp_path, max_steps=3, callbacks=[monitor]))
    trainer.fit(BuiltInConfigureModel(), DataLoader(torch.randn(3 * 8, 2048), batch_size=8))
    states = monitor.report()["model_states"]
    weights = (2048 * 2048 + 2048 + 2048 + 1) * FP32
    assert states["expected"]["params"] == states["measured_model_states"]["params"] == weights
    assert abs(states["unexplained_bytes"]) < 1 * MIB, states  # it was the whole model (16 MiB) before
    assert monitor.findings == []
