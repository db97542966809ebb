"""What the end of a run costs the training process: its CPU time and resident-memory growth, writer process vs in-process.

    python benchmarks/end_cost.py [--pairs 3]

Each arm is a fresh interpreter: a plain ``Monitor`` loop (300 steps, MLP 64-128-64, batch 16)
timed around ``close()``, a Lightning fit (300 steps, TensorBoard logger) timed around the
monitor's ``on_fit_end`` (the files, the console lines and the trackers), and each rank of a
2-rank gloo run (a plain ``Monitor`` around a DDP model) timed around its ``close()``. "writer": the file set
built by the writer process from the journal (the default); "in-process": the training process
builds it itself (``end_write.WRITER = False``, the writer's fallback and the behaviour before
it). CPU time is ``time.process_time()`` of the training process (its threads, not its children);
RSS is ``/proc/self/statm``'s resident set. The arms alternate, ``--pairs`` times. Prints one line
per run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = r"""
import json, os, sys, tempfile, time
import torch
import memcallbacks._runtime.end_write as end_write
end_write.WRITER = sys.argv[2] == "writer"
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

out = {}
def measured(fn):
    def wrapper(*args, **kwargs):
        before, cpu = rss(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            out.update(cpu_s=time.process_time() - cpu, rss_mib=(rss() - before) / 2**20,
                       heavy=sorted(m for m in ("pandas", "matplotlib") if m in sys.modules))
    return wrapper

folder = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp()
if sys.argv[1] == "ranks":  # one rank of a 2-rank gloo run: a plain Monitor around a DDP model
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from memcallbacks import Monitor
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)))
    optimizer = torch.optim.AdamW(model.parameters())
    monitor = Monitor(model, optimizer, output_dir=folder, console_summary=False)
    for x in monitor.track(torch.randn(300, 16, 64)):
        model(x).pow(2).mean().backward(); optimizer.step(); optimizer.zero_grad()
    measured(monitor.close)()
    out["rank"] = dist.get_rank()
    print(json.dumps(out), flush=True)
    os._exit(0)
elif sys.argv[1] == "plain":
    from memcallbacks import Monitor
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    monitor = Monitor(model, optimizer, output_dir=folder, console_summary=False)
    for x in monitor.track(torch.randn(300, 16, 64)):
        model(x).pow(2).mean().backward(); optimizer.step(); optimizer.zero_grad()
    measured(monitor.close)()
else:
    import logging
    import lightning.pytorch as L
    from torch.utils.data import DataLoader
    from memcallbacks import MemoryMonitor
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    MemoryMonitor.on_fit_end = measured(MemoryMonitor.on_fit_end)

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        def training_step(self, b, i):
            return self.net(b).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    trainer = L.Trainer(max_steps=300, default_root_dir=folder, accelerator="cpu", devices=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[MemoryMonitor(console_summary=False)])
    trainer.fit(M(), DataLoader(torch.randn(300 * 16, 64), batch_size=16))
print(json.dumps(out))
"""


def run_one(shape: str, arm: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, shape, arm], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ranks(arm: str, env: dict[str, str]) -> list[dict]:
    """Both ranks of a 2-rank gloo run, each measured around its own ``close()``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    folder = tempfile.mkdtemp()
    procs = [subprocess.Popen([sys.executable, "-c", RUN, "ranks", arm, folder], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("".join(err[-3000:] for _, err in outs))
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[dict]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.pairs):
        for shape in ("plain", "lightning", "ranks"):
            for arm in ("writer", "in-process"):
                for result in (run_ranks(arm, env) if shape == "ranks" else [run_one(shape, arm, env)]):
                    results.setdefault((shape, arm), []).append(result)
                    print(shape, arm, result, flush=True)
    for (shape, arm), runs in results.items():
        print(f"{shape:<10} {arm:<11} CPU {statistics.median(r['cpu_s'] for r in runs):.3f} s, "
              f"RSS +{statistics.median(r['rss_mib'] for r in runs):.1f} MiB (medians of {len(runs)}), "
              f"imported at the end: {runs[-1]['heavy'] or 'nothing heavy'}")


if __name__ == "__main__":
    main()
