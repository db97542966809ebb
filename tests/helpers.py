"""Small models, data modules and log readers shared by the test files (real objects only, no mocks)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "GIB",
    "MIB",
    "touch_temporary",
    "BackwardTemporary",
    "TemporaryNet",
    "RandomDataset",
    "RandomDataModule",
    "BoringModel",
    "TwoOptimizerModel",
    "random_loader",
    "trainer_kwargs",
    "tensorboard_scalars",
    "csv_metrics",
    "wandb_offline_history",
    "mlflow_metrics",
    "is_png",
    "FOUND",
    "announced",
    "free_port",
    "set_rank_environment",
    "flat_settings",
]

GIB = 2**30
MIB = 2**20
FOUND = "found a memory problem"  # in the warning the monitor logs for each new finding


def touch_temporary(mib: int, device: torch.device | str = "cpu") -> int:
    """Allocate ``mib`` MiB on ``device``, write every byte, free it; return the bytes touched.

    On CPU the block is an anonymous mapping of its own (a tensor over it), so its pages come fresh
    from the OS and go back when it is freed: the temporary raises the RSS high-water mark of the
    interval it lives in and nothing after it, however earlier tests in the process left glibc's heap
    (a tensor allocated with ``torch.ones`` is served from a free heap chunk an earlier run left when
    one is large enough, and that chunk stays resident after it: the next step's temporary then raises
    no RSS). On CUDA it raises the caching allocator's peak of that interval.
    """
    if mib <= 0:
        return 0
    nbytes = mib * MIB
    if torch.device(device).type != "cpu":
        temp = torch.ones(nbytes, dtype=torch.uint8, device=device)
        checksum = int(temp[:: 4096].sum())  # read back one byte per page: the pages are really there
        del temp
    else:
        with mmap.mmap(-1, nbytes) as mapping:
            temp = torch.frombuffer(mapping, dtype=torch.uint8)
            temp.fill_(1)
            checksum = int(temp[:: 4096].sum())
            del temp
    assert checksum == nbytes // 4096
    return nbytes


class BackwardTemporary(torch.autograd.Function):
    """Identity in forward; its backward allocates (and frees) a touched temporary of ``mib`` MiB."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mib: int) -> torch.Tensor:
        ctx.mib = mib
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        touch_temporary(ctx.mib, grad.device)
        return grad, None


class TemporaryNet(nn.Module):
    """A small MLP with a forward temporary and/or a backward temporary of known size (CPU)."""

    def __init__(self, forward_mib: int = 0, backward_mib: int = 0, dim: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))
        self.forward_mib, self.backward_mib = forward_mib, backward_mib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        touch_temporary(self.forward_mib)
        out = self.net(x)
        return BackwardTemporary.apply(out, self.backward_mib) if self.backward_mib else out


class RandomDataset(Dataset):
    """``length`` deterministic random vectors of size ``dim``."""

    def __init__(self, dim: int = 32, length: int = 64, seed: int = 0) -> None:
        self.data = torch.randn(length, dim, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


def random_loader(batches: int = 8, batch_size: int = 4, dim: int = 32, seed: int = 0) -> DataLoader:
    return DataLoader(RandomDataset(dim, batches * batch_size, seed), batch_size=batch_size)


class RandomDataModule(L.LightningDataModule):
    """Train/val/test/predict loaders of random vectors; ``batches`` batches each (val/test/predict: ``eval_batches``)."""

    def __init__(self, dim: int = 32, batches: int = 8, eval_batches: int = 2, batch_size: int = 4) -> None:
        super().__init__()
        self.dim, self.batches, self.eval_batches, self.batch_size = dim, batches, eval_batches, batch_size

    def train_dataloader(self) -> DataLoader:
        return random_loader(self.batches, self.batch_size, self.dim, seed=0)

    def val_dataloader(self) -> DataLoader:
        return random_loader(self.eval_batches, self.batch_size, self.dim, seed=1)

    def test_dataloader(self) -> DataLoader:
        return random_loader(self.eval_batches, self.batch_size, self.dim, seed=2)

    def predict_dataloader(self) -> DataLoader:
        return random_loader(self.eval_batches, self.batch_size, self.dim, seed=3)


class BoringModel(L.LightningModule):
    """A two-layer MLP with knobs for memory experiments.

    Args:
        dim: input width.
        forward_temp_mib: a touched temporary allocated and freed inside ``training_step`` (the forward phase).
        backward_temp_mib: a touched temporary allocated and freed inside the backward pass.
        rank_temp_mib: like ``forward_temp_mib`` but only on global rank 1 (distributed tests).
        oom_at_step: raise ``torch.OutOfMemoryError`` from ``training_step`` at this global step.
    """

    def __init__(
        self,
        dim: int = 32,
        lr: float = 0.1,
        forward_temp_mib: int = 0,
        backward_temp_mib: int = 0,
        rank_temp_mib: int = 0,
        oom_at_step: int | None = None,
    ) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))
        self.lr = lr
        self.forward_temp_mib = forward_temp_mib
        self.backward_temp_mib = backward_temp_mib
        self.rank_temp_mib = rank_temp_mib
        self.oom_at_step = oom_at_step
        self.training_steps_run = 0
        self.eval_steps_run = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.training_steps_run += 1
        if self.oom_at_step is not None and self.global_step == self.oom_at_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated by the test model)")
        touch_temporary(self.forward_temp_mib, self.device)
        if self.rank_temp_mib and self.global_rank == 1:
            touch_temporary(self.rank_temp_mib, self.device)
        out = self(batch)
        if self.backward_temp_mib:
            out = BackwardTemporary.apply(out, self.backward_temp_mib)
        loss = out.pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.eval_steps_run += 1
        self.log("val_loss", self(batch).pow(2).mean())

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.eval_steps_run += 1
        self.log("test_loss", self(batch).pow(2).mean())

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.eval_steps_run += 1
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TwoOptimizerModel(L.LightningModule):
    """GAN-like manual optimization: two sub-networks, two optimizers, two backward passes per batch."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(dim, 1))
        self.training_steps_run = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.training_steps_run += 1
        opt_g, opt_d = self.optimizers()
        fake = self.generator(batch)
        loss_d = (self.discriminator(fake.detach()) - self.discriminator(batch)).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = -self.discriminator(self.generator(batch)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.log_dict({"loss_d": loss_d, "loss_g": loss_g})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3), torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]


def trainer_kwargs(tmp_path: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """The CPU Trainer settings every test uses; ``overrides`` win."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        max_steps=4,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def announced(caplog: Any) -> list[logging.LogRecord]:
    """The records in ``caplog`` (a ``pytest.LogCaptureFixture``) that announce a finding."""
    return [r for r in caplog.records if FOUND in r.getMessage()]


# ---------------------------------------------------------------------- processes
TEARDOWN_ABORT = "terminate called without an active exception"
"""gloo's abort at a rank process's exit (a std::thread destroyed while joinable), after the rank's work:
torch's teardown, seen under load; tests of what the ranks did accept it once their work is done."""


def end_process_group() -> None:
    """A Lightning DDP script's last line: the process group destroyed before the interpreter exits. Lightning
    leaves it alive, and gloo's worker threads torn down at interpreter exit abort the process now and then
    (:data:`TEARDOWN_ABORT`; pytorch/pytorch#190489). The barrier first: no rank closes its connections while the
    other still reads the last collective's bytes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_as_shown(command: str, cwd: str | os.PathLike[str], *, env: dict[str, str] | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    """A command line as the docs show it, through the shell, with this environment's ``python`` and
    ``memcallbacks`` first on ``PATH`` and the project importable; it must exit 0."""
    base = dict(os.environ if env is None else env)
    base.update(PATH=str(Path(sys.executable).parent) + os.pathsep + base.get("PATH", ""), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(command, shell=True, cwd=str(cwd), env=base, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
    return done


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """In a forked rank: the environment ``env://`` rendezvous reads (one node, ``port`` on 127.0.0.1),
    and one intra-op thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


RANK_TIMEOUT_S = 240.0
"""How long a test's ranks may run: a rank still running then prints every thread's stack and
exits non-zero, and :func:`run_ranks` fails the test naming it (a hang would otherwise hold the
worker until CI's limit)."""


def _rank_with_deadline(rank: int, fn: Any, timeout_s: float, *args: Any) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(timeout_s, exit=True)  # the stacks go to the rank's stderr
    fn(rank, *args)


def run_ranks(fn: Any, args: tuple[Any, ...], nprocs: int = 2, start_method: str = "fork",
              timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes and wait for them; a rank that fails, or is
    still running after ``timeout_s`` (its stacks printed), fails the test with a message."""
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_with_deadline, args=(fn, timeout_s, *args), nprocs=nprocs, join=False,
                                 start_method=start_method)
    deadline = time.monotonic() + timeout_s + 30
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"ranks {alive} of {nprocs} were still running {timeout_s + 30:.0f} s after "
                                     f"they started; their stacks (faulthandler) are in the captured stderr")
    except mp.ProcessExitedException as exc:
        raise AssertionError(f"a rank failed: {exc} (a hang past {timeout_s:.0f} s ends as exit code 1 with the "
                             f"rank's stacks printed to its stderr)") from exc


def leave_rank() -> None:
    """The last line of a forked rank that trained a DDP model: leave the process at once, without
    freeing the rank function's locals or tearing down the interpreter. The DDP model's reducer can
    hold the last reference to the gloo process group, and ``~ProcessGroupGloo`` joins its run-loop
    thread while holding the GIL that thread may be waiting for: the rank then hangs for good (both
    ranks of test_accelerate's DDP run, 16 minutes in ``~ProcessGroupGloo``, under ``pytest -n 2``).
    What the test reads is written by then (the monitor's files at ``close()``, the trackers'
    at the framework's end of training)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------- reading logs back from disk
def tensorboard_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in every event file under ``log_dir``: ``{tag: [(step, value), ...]}`` sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(glob.glob(os.path.join(str(log_dir), "**", "events.out.tfevents.*"), recursive=True))
    assert files, f"no TensorBoard event file under {log_dir}"
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, float(e.value)) for e in acc.Scalars(tag))
    return {tag: sorted(points) for tag, points in out.items()}


def csv_metrics(metrics_csv: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """CSVLogger's ``metrics.csv`` as ``{column: [(step, value), ...]}`` (empty cells dropped)."""
    import pandas as pd

    frame = pd.read_csv(metrics_csv)
    out: dict[str, list[tuple[int, float]]] = {}
    for column in frame.columns:
        if column == "step":
            continue
        present = frame[frame[column].notna()]
        out[column] = sorted((int(s), float(v)) for s, v in zip(present["step"], present[column]))
    return out


_WANDB_BLOCK = 32768
_WANDB_RECORD_HEADER = 7


def _wandb_records(path: str, complete_only: bool = False) -> list[bytes]:
    """Read the records of a ``.wandb`` transaction log (LevelDB log format with W&B's file header).

    wandb >= 0.20 ships no Python reader for its own run files (``wandb.sdk.internal.datastore``
    is gone; the Go core writes them), so this decodes the documented framing: a 7-byte file
    header ``:W&B``, magic, version; then 32 KiB blocks of records, each ``crc32 (4) | length (2)
    | type (1)``, type 1 = full, 2/3/4 = first/middle/last fragment.
    """
    with open(path, "rb") as fh:
        data = fh.read()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B run file (header {data[:7]!r})"
    records: list[bytes] = []
    pending = b""
    pos = 7
    while pos + _WANDB_RECORD_HEADER <= len(data):
        left_in_block = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left_in_block < _WANDB_RECORD_HEADER:
            pos += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + _WANDB_RECORD_HEADER])
        if kind == 0 and length == 0:
            pos += left_in_block  # zero padding at the end of a block
            continue
        payload = data[pos + _WANDB_RECORD_HEADER : pos + _WANDB_RECORD_HEADER + length]
        if complete_only and len(payload) < length:
            break  # the writer is still writing this record
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != checksum:
            raise AssertionError(f"bad checksum in {path} at byte {pos}")
        pos += _WANDB_RECORD_HEADER + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
            pending = b""
    return records


def wandb_offline_history(wandb_dir: str | os.PathLike[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The history rows (``wandb.log`` calls) of the single offline run under ``wandb_dir``.

    ``wandb.finish()`` can return before the wandb-core service has flushed the run file, so
    this waits (up to ``timeout_s``) for the run's closing ``exit`` record.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        files = glob.glob(os.path.join(str(wandb_dir), "**", "offline-run-*", "*.wandb"), recursive=True)
        assert len(files) <= 1, f"expected one offline run file under {wandb_dir}, found {files}"
        records = []
        if files:
            for payload in _wandb_records(files[0], complete_only=True):
                record = pb.Record()
                record.ParseFromString(payload)
                records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the offline run under {wandb_dir} was not closed within {timeout_s}s: {files}")
        time.sleep(0.2)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def mlflow_metrics(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of ``run_id`` read back through a fresh ``MlflowClient``: ``{key: [(step, value), ...]}``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    out = {}
    for key in run.data.metrics:
        out[key] = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return out


def open_problems(report: dict[str, Any]) -> list[dict[str, Any]]:
    """``report.json``'s findings that are open problems (``Finding.is_problem``: not settled, not advice):
    on a clean run, its false alarms."""
    return [f for f in report["findings"] if f["state"] == "open" and f["severity"] == "problem"]


def is_png(path: str | os.PathLike[str]) -> bool:
    """A complete PNG: signature, IHDR first with a non-empty size, IEND last."""
    data = Path(path).read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR" or not data.endswith(b"IEND\xaeB`\x82"):
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width > 0 and height > 0


def flat_settings(**flat: Any) -> Any:
    """The runtime's settings for settings given by their flat names (``gc_every_n_steps=10``,
    ``snapshot_steps=2``), for tests that build a runtime part (a StepPlan, a Session) on its own."""
    from memcallbacks._base.config import MonitorConfig, settings_of
    from memcallbacks._base.options import FLAT_NAMES

    given: dict[str, Any] = {}
    for name, value in flat.items():
        group, field = FLAT_NAMES.get(name, ("", name))
        if group:
            given.setdefault(group, {})[field] = value
        else:
            given[name] = value
    return settings_of(MonitorConfig(**given))


@contextlib.contextmanager
def tiny_tmpfs(folder: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs mounted on ``folder`` (made here), unmounted after; the test is skipped, with the reason,
    where none can be mounted (it needs root)."""
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root); the full-disk case is untested")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full, to the last byte."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


CUDA_LIMIT = 2 << 30
"""What the ``cuda_limited`` fixture (tests/conftest.py) leaves this process of the GPU: a per-process memory fraction."""
