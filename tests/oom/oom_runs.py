"""Real out-of-memory runs for tests/oom: a driver process that forks one child per run, each under ``RLIMIT_AS``.

``python oom_runs.py <framework> <budget_mib> <out.json> <model>/<run> ...`` imports everything once,
builds nothing, then forks: each child sets its address-space limit to the driver's address space at the model's first run
plus ``budget_mib`` and trains. Runs: ``grow`` (the batch doubles every step until the allocator
fails), ``fixed:<n>`` (batch ``n`` for 2 steps: the first makes the optimizer's state, the second runs with it),
``jump:<n>`` (batch 2 for 10 steps, then ``n`` for 2; the monitor at its defaults, as README shows it), ``leak`` (a
constant batch, and the model keeps 11 MiB more every step), ``fits`` (the model's first run again at the batch its
explanation says fits, and at twice that batch), ``savings`` (in the driver, no limit: the failed step measured with
each predicted change).
Each child writes what happened as JSON; the driver collects them into ``out.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("MALLOC_ARENA_MAX", "1")  # one glibc arena: no 64 MiB reservation per thread
import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

# MLP: one sample is 512 tokens, about 12 MiB of activations. Narrow blocks: the activations are mostly the 1024-wide
# ones, the matmuls' work is DIM x HIDDEN; at DIM 256 a sample held 13.5 MiB for 4x the work (the file's runs took 2x as long)
SEQ, DIM, HIDDEN = 512, 64, 1024
T_SEQ, T_DIM, HEADS = 512, 128, 4  # transformer: attention scores of 512 x 512 per head, about 38 MiB a sample
LEAK_MIB = 11
FIRST_FORWARD: dict[str, int] = {}  # the process before its first step: VmSize, and the tensors then alive
MONITOR = dict(advanced={"cpu_mmap_threshold": 1 << 20}, sample_every_n_steps=1, log_every_n_steps=1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Attention written out (the math an unfused kernel does), so every saved tensor is a visible tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(T_DIM, 3 * T_DIM), nn.Linear(T_DIM, T_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-1, -2)
        scores = att * (d // HEADS) ** -0.5
        probs = scores.softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(T_DIM), Attention(), nn.LayerNorm(T_DIM)
        self.mlp = nn.Sequential(nn.Linear(T_DIM, 4 * T_DIM), nn.GELU(), nn.Linear(4 * T_DIM, T_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    """``model(x)`` -> outputs; ``model(x=x, labels=y)`` -> ``{"loss": ...}`` (what the Trainer calls)."""

    def __init__(self, kind: str, leak: bool = False) -> None:
        super().__init__()
        if kind == "mlp":
            self.blocks = nn.Sequential(Block(), Block(), Block())
            self.head = nn.Linear(DIM, 10)
        else:
            self.blocks = nn.Sequential(Layer(), Layer(), Layer())
            self.head = nn.Linear(T_DIM, 10)
        self.leak = leak
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        if not FIRST_FORWARD and self.training:  # every framework object, thread and import exists by now
            tensors = sum(p.numel() * p.element_size() for p in self.parameters()) + x.numel() * x.element_size()
            FIRST_FORWARD.update(vm=vm_size(), tensors=tensors + (labels.numel() * labels.element_size() if labels is not None else 0))
        out = self.head(self.blocks(x))
        if self.leak and self.training:  # each step's output kept: LEAK_MIB more every step
            self.kept.append(torch.ones(LEAK_MIB << 20, dtype=torch.uint8))
        if labels is None:
            return out
        return {"loss": loss_of(out, labels)}


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, 10), y.reshape(-1))


def batch(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    seq, dim = (SEQ, DIM) if kind == "mlp" else (T_SEQ, T_DIM)
    return torch.randn(n, seq, dim, generator=g), torch.randint(0, 10, (n, seq), generator=g)


def sizes(run: str) -> list[int]:
    if run == "grow":
        return [2 << i for i in range(12)]
    if run == "leak":
        return [2] * 200
    if run.startswith("jump:"):
        return [2] * 10 + [int(run.split(":")[1])] * 2
    return [int(run.split(":")[1])] * 2


def config(run: str) -> dict[str, Any]:
    """The jump runs' monitor is at its defaults (glibc's adaptive heap, the default sampling); the others sample every
    step with glibc's mmap threshold fixed, so that the categories can be checked against the process's own figure."""
    return {} if run.startswith("jump:") else MONITOR


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


# ---------------------------------------------------------------------- one framework each
def train_plain(kind: str, run: str, out: Path) -> int:
    from memcallbacks import Monitor

    model = Net(kind, leak=run == "leak")
    optimizer = make_optimizer(model)
    data = (batch(kind, n) for n in sizes(run))
    steps = 0
    with Monitor(model, optimizer, output_dir=str(out), **config(run)) as monitor:
        for x, y in monitor.track(data):
            loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps


def train_lightning(kind: str, run: str, out: Path) -> int:
    import lightning.pytorch as L

    from memcallbacks import MemoryMonitor

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(kind, leak=run == "leak")

        def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
            x, y = b
            return loss_of(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self)

    data = _Lazy(kind, run)
    trainer = L.Trainer(callbacks=[MemoryMonitor(output_dir=str(out), **config(run))], max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(out), accelerator="cpu", devices=1)
    trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=None))
    return trainer.global_step


class _Lazy(torch.utils.data.Dataset):  # batches made as the loader asks: none is built in advance
    def __init__(self, kind: str, run: str) -> None:
        self.kind, self.sizes = kind, sizes(run)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> Any:
        return batch(self.kind, self.sizes[i])


def train_accelerate(kind: str, run: str, out: Path) -> int:
    from accelerate import Accelerator

    from memcallbacks.accelerate import AccelerateMemoryMonitor

    accelerator = Accelerator(cpu=True)
    model = Net(kind, leak=run == "leak")
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    monitor = AccelerateMemoryMonitor(accelerator, model, optimizer, output_dir=str(out), **config(run))
    steps = 0
    with monitor:
        for x, y in monitor.track(batch(kind, n) for n in sizes(run)):
            accelerator.backward(loss_of(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def train_transformers(kind: str, run: str, out: Path) -> int:
    from transformers import Trainer, TrainingArguments

    from memcallbacks.transformers import MemoryMonitorCallback

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(sizes(run))

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = batch(kind, sizes(run)[i])
            return {"x": x, "labels": y}

    class Growing(Trainer):
        def get_train_dataloader(self) -> Any:  # one batch per item: the batch size is the data's
            return torch.utils.data.DataLoader(Batches(), batch_size=None)

    monitor = MemoryMonitorCallback(output_dir=str(out), **config(run))
    args = TrainingArguments(output_dir=str(out / "trainer"), report_to=[], max_steps=len(sizes(run)), learning_rate=1e-4,
                             save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    model = Net(kind, leak=run == "leak")
    trainer = Growing(model=model, args=args, callbacks=[monitor], optimizers=(make_optimizer(model), None))
    try:
        trainer.train()
    except BaseException as exc:
        monitor.record_exception(exc)
        raise
    return trainer.state.global_step


TRAIN = {"plain": train_plain, "lightning": train_lightning, "accelerate": train_accelerate, "transformers": train_transformers}


# ---------------------------------------------------------------------- the driver
def vm_size() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


def child(framework: str, kind: str, run: str, limit: int, out: Path, result: Path) -> None:
    record: dict[str, Any] = {"run": run, "limit": limit, "base_vm": vm_size(), "output_dir": str(out)}
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        record["steps"] = TRAIN[framework](kind, run, out)
        record["completed"] = True
    except BaseException as exc:  # what the run raised, unchanged by the monitor
        record.update(completed=False, error=f"{type(exc).__name__}: {exc}"[:500], error_type=type(exc).__name__,
                      trace=traceback.format_exc()[-1500:])
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    oom = out / "oom.json"
    record["oom"] = json.loads(oom.read_text()) if oom.is_file() else None
    record["first_forward"] = dict(FIRST_FORWARD)
    report = out / "report.json"
    record["findings"] = json.loads(report.read_text()).get("findings") if report.is_file() else None
    result.write_text(json.dumps(record))


def fork_run(framework: str, kind: str, run: str, limit: int, tries: int = 2) -> dict[str, Any]:
    """One run in a forked child under the address-space ``limit``. A child killed by a signal (a C++ allocation
    failure in a path that cannot throw aborts the process: where the limit is hit moves with the heap) is run once
    more; its fault log is kept."""
    out = Path(tempfile.mkdtemp(prefix=f"oom-{framework}-{kind}-"))
    result, fault = out / "result.json", out / "fault.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with open(fault, "w") as fh:
                faulthandler.enable(fh)  # a fatal signal's Python traceback, for the record
                child(framework, kind, run, limit, out / "memcallbacks", result)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if result.is_file():
        return json.loads(result.read_text())
    crashed = {"run": run, "crashed": f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}",
               "fault": fault.read_text()[-3000:] if fault.is_file() else ""}
    print(f"oom_runs: {framework} {kind} {run}: the child died ({crashed['crashed']}):\n{crashed['fault']}", file=sys.stderr)
    if os.WIFSIGNALED(status) and tries > 1:
        return dict(fork_run(framework, kind, run, limit, tries - 1), crashed_before=crashed)
    return crashed


def preload(framework: str) -> None:
    """Import what the runs import, before forking: every child starts from the same address space."""
    import matplotlib.pyplot  # noqa: F401  # the files written after the failure import these
    import pandas  # noqa: F401

    import psutil  # noqa: F401  # the monitor's host reads
    import torch._dynamo  # noqa: F401  # a process's first optimizer imports it: 2.4 s in each child otherwise
    from PIL import Image  # noqa: F401  # the plots' writer loads its formats on first use

    import memcallbacks.oom  # noqa: F401
    import memcallbacks.preflight  # noqa: F401
    from memcallbacks import Monitor  # noqa: F401  # not in each child: its imports are a second a run

    Image.init()
    if framework == "lightning":
        import lightning.pytorch  # noqa: F401

        import memcallbacks.lightning  # noqa: F401
    elif framework == "accelerate":
        import accelerate  # noqa: F401

        import memcallbacks.accelerate  # noqa: F401
    elif framework == "transformers":
        import transformers  # noqa: F401
        from transformers import Trainer  # noqa: F401

        import memcallbacks.transformers  # noqa: F401


def measured_savings(kind: str, explanation: dict[str, Any]) -> dict[str, Any]:
    """Re-run the failed step for real, without a limit, with each predicted change: the measured saving at the peak."""
    from torch.utils.checkpoint import checkpoint

    from memcallbacks.preflight import measure_step

    remedies = {r["kind"]: r for r in explanation["remedies"]}
    size = explanation["batch_size"]

    def peak(checkpointed: list[str] = (), optimizer: str = "adamw") -> int:
        torch.manual_seed(0)
        model = Net(kind)
        for name in checkpointed:
            sub = model.get_submodule(name)
            sub.forward = lambda *a, _f=sub.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        opt = make_optimizer(model) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        loss = lambda m, b: m(b).float().sum()  # noqa: E731
        # the warm-up step (it makes the optimizer's state, as the failed step had it) on a batch of 1: the state's
        # size is the parameters', not the batch's, and the measured step starts with no gradients either way; the
        # phases measured at the failed batch are the same to the byte as after a warm-up at that batch, for half the time
        loss(model, batch(kind, 1)[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x, _ = batch(kind, size)
        phases = measure_step(model, x, opt, loss, warmup_steps=0)
        return max(phases[p] for p in ("forward", "backward", "optimizer"))

    base = peak()
    out: dict[str, Any] = {"base_peak": base}
    if "checkpointing" in remedies:
        out["checkpointing"] = base - peak(checkpointed=remedies["checkpointing"]["details"]["modules"])
    if "optimizer" in remedies:
        out["optimizer"] = base - peak(optimizer=remedies["optimizer"]["details"]["optimizer"])
    return out


def main(argv: list[str]) -> None:
    """``framework budget_mib out.json model/run ...``: runs in order; ``fits`` and ``savings`` read the model's first run."""
    framework, budget_mib, out = argv[:3]
    budget = int(budget_mib) << 20
    preload(framework)
    results: list[dict[str, Any]] = []
    limits: dict[str, int] = {}  # one limit per model, set at its first run: the driver's address space moves by a MiB
    for spec in argv[3:]:  # between runs (the results it reads), and a model's runs are compared under the same limit
        kind, run = spec.split("/")
        limit = limits.setdefault(kind, vm_size() + budget)
        first = next((r for r in results if r["model"] == kind), {})
        if run == "fits":  # the first run again at the batch its explanation says fits, and at twice that batch
            remedy = next((r for r in (first.get("oom") or {}).get("remedies", []) if r["kind"] == "batch_size"), None)
            n = (remedy or {}).get("details", {}).get("batch_size")
            shape = "jump" if first["run"].startswith("jump:") else "fixed"
            for size in (n, 2 * n) if n else ():
                results.append(dict(fork_run(framework, kind, f"{shape}:{size}", limit), model=kind))
        elif run == "savings":  # in the driver itself, no limit: the measured effect of the predicted changes
            results.append({"run": "savings", "model": kind, **measured_savings(kind, first["oom"])})
        else:
            results.append(dict(fork_run(framework, kind, run, limit), model=kind))
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
