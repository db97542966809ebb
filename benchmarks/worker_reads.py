"""DataLoader workers: the step at which copy on access is found, and what the worker reads cost.

Each run is a process of its own: a plain ``Monitor`` (or Lightning's ``MemoryMonitor``) at default
settings over ``--steps`` steps of ``--pace`` seconds (a sleep after a small MLP step, standing in
for a device-bound step), with ``--workers`` DataLoader workers over one of three Datasets:

- ``records``: 200,000 Python dicts (copy on access: each worker's private memory grows);
- ``images``: a ``3x224x224`` float tensor an item, batches of 64 (38.5 MB a batch: the workers'
  allocator maps and unmaps memory, many page faults and no growth);
- ``arrays``: one tensor (clean).

Prints, per run, the step the ``worker_growth`` finding was first raised at (``-`` for none), the
watch's reads (all, and those its page faults asked for), its time, and the monitor's own time after
its first 48 steps (``overhead_after_start``, finding work aside) with the finding work beside it.

    python benchmarks/worker_reads.py --pace 0.002 --steps 200 --repeat 3
    python benchmarks/worker_reads.py --pace 0.2 --steps 200
    python benchmarks/worker_reads.py --data arrays --workers 4 --pace 0.1 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

RECORDS_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "host")
"""Where the ``records`` Dataset is (``tests/host/worker_data.py``, shared with the workers' tests)."""

SCRIPT = textwrap.dedent('''
    import json, sys, time, warnings
    import torch
    from worker_data import Records  # tests/host/worker_data.py, on PYTHONPATH (run_once())
    warnings.filterwarnings("ignore")
    ADAPTER, DATA, WORKERS, STEPS, PACE, EPOCH, OUT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        float(sys.argv[5]), int(sys.argv[6]), sys.argv[7]

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000
        def __getitem__(self, i):
            return torch.full((3, 224, 224), float(i % 7))

    class Arrays(torch.utils.data.Dataset):
        def __init__(self, n):
            self.data = torch.arange(64 * n, dtype=torch.float32).reshape(n, 64)
        def __len__(self):
            return len(self.data)
        def __getitem__(self, i):
            return self.data[i]

    data = {"records": lambda: Records(200_000), "images": Images, "arrays": lambda: Arrays(200_000)}[DATA]()
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True, num_workers=WORKERS,
                                         persistent_workers=EPOCH == 0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

    def batches():
        n = 0
        while n < STEPS:
            for i, batch in enumerate(loader):
                yield batch.reshape(-1, 64)[:64]
                n += 1
                if n >= STEPS or (EPOCH and i + 1 >= EPOCH):
                    break

    if ADAPTER == "plain":
        from memcallbacks import Monitor
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        monitor = Monitor(net, opt, output_dir=OUT)
        for batch in monitor.track(batches()):
            loss = net(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(PACE)
        monitor.close()
    else:
        import lightning.pytorch as L
        from memcallbacks import MemoryMonitor

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = net
            def training_step(self, batch, batch_idx):
                time.sleep(PACE)
                return self.net(batch.reshape(-1, 64)[:64]).pow(2).mean()
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)
            def train_dataloader(self):
                return loader

        monitor = MemoryMonitor(output_dir=OUT)
        trainer = L.Trainer(max_steps=STEPS, logger=False, accelerator="cpu", devices=1, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=OUT)
        trainer.fit(Module())
''')


def run_once(args: argparse.Namespace, folder: str) -> dict:
    script = os.path.join(folder, "fit.py")
    with open(script, "w") as fh:
        fh.write(SCRIPT)
    out = os.path.join(folder, "out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [RECORDS_FOLDER, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, script, args.adapter, args.data, str(args.workers), str(args.steps), str(args.pace),
                           str(args.epoch), out], capture_output=True, text=True, env=env, cwd=folder, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    with open(os.path.join(out, "report.json")) as fh:
        report = json.load(fh)
    found = [f for f in report["findings"] if f["kind"] == "worker_growth"]
    host = report.get("host") or {}
    workers = host.get("workers") or {}
    cadence = report["summary"]["cadence"]
    return {
        "found_at_step": found[0]["first_step"] if found else None,
        "cause": found[0]["details"]["cause"] if found else None,
        "workers": [(w["first_step"], w["reads"], w["first_uss_bytes"] >> 20, w["uss_bytes"] >> 20, w.get("kept_share")) for w in found[0]["details"]["workers"]] if found else None,
        "reads": workers.get("reads"),
        "uss_reads": workers.get("uss_reads"),
        "fault_reads": workers.get("fault_reads"),
        "watch_s": workers.get("seconds"),
        "finding_s": workers.get("finding_seconds"),
        "overhead_after_start": cadence.get("overhead_after_start"),
        "finding_time_s": cadence.get("finding_time_s"),
        "step_s": cadence.get("step_time_median_s"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pace", type=float, default=0.002, help="seconds of sleep a step (default 0.002)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", choices=("records", "images", "arrays"), default="records")
    parser.add_argument("--epoch", type=int, default=0, help="non-persistent workers, a new set every this many steps (0: persistent)")
    parser.add_argument("--adapter", choices=("plain", "lightning"), default="plain")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    if args.pace < 0 or args.steps < 1 or args.workers < 1 or args.repeat < 1 or args.epoch < 0:
        parser.error("--pace >= 0, --steps, --workers and --repeat >= 1, --epoch >= 0")
    print(f"{args.adapter}, {args.data}, {args.workers} workers, {args.steps} steps of {args.pace * 1e3:.0f} ms + the step, "
          f"{'persistent' if not args.epoch else f'a new set every {args.epoch} steps'}")
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as folder:
            row = run_once(args, folder)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
