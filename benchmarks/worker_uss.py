"""What a monitored run costs its DataLoader workers: each worker's USS, bare and monitored, read from outside.

Runs a training script twice at a time, bare and with a default ``Monitor`` (A/B alternating, a process
each), and reads every DataLoader worker's USS (``/proc/<pid>/smaps_rollup``) from this process every
``--every`` seconds. Prints, per run, each worker's first and peak USS in MiB in the order the workers
started (training workers, then evaluation workers, per epoch when they are not persistent).

- ``imagenet`` (always): ``tests/scripts/imagenet_style.py``, an ImageFolder of JPEGs decoded with PIL,
  4 training and 4 evaluation workers, 3 epochs; ``--armed`` leaves the parent's collector a few thousand
  objects short of a full collection when its workers start (as timm's ``train.py`` leaves it).
- ``timm`` (with ``--timm-train``): timm's own ``train.py`` (``--model resnet10t --img-size 32 -b 32
  --epochs 2 -j 2 --device cpu`` on an ImageFolder of 48x48 JPEGs, 10 classes, 4,096 training and 512
  validation images, made once), the monitor put around its loop from outside: ``train_one_epoch`` gets
  ``monitor.track(loader)`` and ``validate`` runs inside ``monitor.evaluate()``. Skipped without timm:
  timm and torchvision are not dependencies (``pip install --no-deps --target DIR timm torchvision`` and
  ``--timm-path DIR``; a CUDA build of torchvision on a CPU torch needs its operator schemas, defined here).
  ``--worker-table N``: each worker keeps N small lists at its start (``worker_init_fn``).

    python benchmarks/worker_uss.py --repeat 2
    python benchmarks/worker_uss.py --armed
    python benchmarks/worker_uss.py --timm-train ~/pytorch-image-models/train.py --timm-path /tmp/timm --worker-table 6000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from memcallbacks.host.readers import smaps_rollup

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
IMAGENET = os.path.join(ROOT, "tests", "scripts", "imagenet_style.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "host"))
from worker_procs import children, cmdline  # noqa: E402  (tests/host/worker_procs.py, shared with the scenario test)

TIMM_RUNNER = textwrap.dedent('''
    import contextlib, importlib.util, json, os, sys
    import torch
    MONITOR, TRAIN_PY, TABLE = sys.argv[1] == "monitored", sys.argv[2], int(sys.argv[3])
    lib = torch.library.Library("torchvision", "FRAGMENT")  # a CUDA torchvision on a CPU torch: its schemas
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    if TABLE:
        import timm.data.loader as timm_loader
        seeding = timm_loader._worker_init
        def worker_init(worker_id, worker_seeding="all", _kept=[]):
            _kept.extend([i] for i in range(TABLE))  # a worker keeps a small table it builds at its start
            return seeding(worker_id, worker_seeding)
        timm_loader._worker_init = worker_init
    spec = importlib.util.spec_from_file_location("timm_train", TRAIN_PY)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    state = {}

    class Tracked:
        """The loader, iterated through monitor.track(); everything else is the loader's."""
        def __init__(self, loader, monitor):
            self._loader, self._monitor = loader, monitor
        def __iter__(self):
            return iter(self._monitor.track(self._loader))
        def __len__(self):
            return len(self._loader)
        def __getattr__(self, name):
            return getattr(self._loader, name)

    one_epoch, validate = train.train_one_epoch, train.validate
    def train_one_epoch(epoch, model, loader, optimizer, args, **kwargs):
        if MONITOR and "monitor" not in state:
            from memcallbacks import Monitor
            state["monitor"] = Monitor(model, optimizer, output_dir=os.path.join(os.getcwd(), "memcallbacks"))
        if MONITOR:
            loader = Tracked(loader, state["monitor"])
        return one_epoch(epoch, model, loader, optimizer, args, **kwargs)
    def evaluate(*args, **kwargs):
        with state["monitor"].evaluate() if "monitor" in state else contextlib.nullcontext():
            return validate(*args, **kwargs)
    train.train_one_epoch, train.validate = train_one_epoch, evaluate
    sys.argv = [TRAIN_PY, *sys.argv[4:]]
    train.main()
    findings = []
    if "monitor" in state:
        state["monitor"].close()
        findings = [f.to_dict() for f in state["monitor"].findings]
    json.dump({"findings": findings}, open("result.json", "w"))
''')


def watch(runs: dict[str, tuple[list[str], str, dict[str, str]]], every: float) -> dict[str, dict]:
    """Start the runs at once (``name -> (command, folder, env)``); until they end, read their workers' USS (their
    children with the same command line) every ``every`` seconds. Per run: each worker's (first, peak) USS."""
    procs, series = {}, {}
    for name, (cmd, folder, env) in runs.items():
        procs[name] = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        series[name] = {}
    while any(p.poll() is None for p in procs.values()):
        for name, proc in procs.items():
            parent = cmdline(proc.pid) if proc.poll() is None else None
            for child in children(proc.pid) if parent else []:
                if child in series[name] or cmdline(child) == parent:
                    uss = (smaps_rollup(child) or {}).get("uss")
                    if uss is not None:
                        first, peak = series[name].get(child, (uss, 0))
                        series[name][child] = (first, max(peak, uss))
        time.sleep(every)
    out = {}
    for name, proc in procs.items():
        output = proc.communicate()[0]
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{output[-3000:]}")
        out[name] = {"workers": list(series[name].values()), "folder": runs[name][1]}
    return out


def _summary(name: str, run: dict) -> dict:
    with open(os.path.join(run["folder"], "result.json")) as f:
        findings = json.load(f)["findings"]
    mib = [(round(a / 2**20, 1), round(b / 2**20, 1)) for a, b in run["workers"]]
    problems = [f"{f['kind']}@{f['first_step']}" for f in findings if f["state"] == "open" and f["severity"] == "problem"]
    return {"run": name, "workers_first_peak_mib": mib, "problems": problems}


def imagenet(args: argparse.Namespace, folder: str, data: str) -> None:
    extra = ["--persistent"] if not args.per_epoch else []
    extra += ["--armed"] if args.armed else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in ("bare", "monitored"):
        out = os.path.join(folder, name)
        os.makedirs(out, exist_ok=True)
        flags = [*extra, "--monitor"] if name == "monitored" else extra
        runs[name] = ([sys.executable, IMAGENET, out, "--data", data, *flags], out, env)
    for name, run in watch(runs, args.every).items():
        print(json.dumps(_summary(f"imagenet {name}", run)))


def make_jpeg_folder(root: str) -> None:
    """timm's scenario: 48x48 JPEGs, 10 classes, 4,096 training and 512 validation (made once)."""
    if os.path.exists(os.path.join(root, ".done")):
        return
    import numpy as np
    from PIL import Image

    for split, n in (("train", 4096), ("validation", 512)):
        for i in range(n):
            folder = os.path.join(root, split, f"class{i % 10}")
            os.makedirs(folder, exist_ok=True)
            pixels = np.random.default_rng(i).integers(0, 256, (48, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i}.jpg"), quality=90)
    open(os.path.join(root, ".done"), "w").close()


def timm(args: argparse.Namespace, folder: str, data: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [args.timm_path, os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('timm') is not None)"],
                           env=env, capture_output=True, text=True)
    if probe.stdout.strip() != "True" or not os.path.exists(args.timm_train):
        print("timm: skipped (timm is not importable, or --timm-train is not timm's train.py)")
        return
    make_jpeg_folder(data)
    runner = os.path.join(folder, "timm_runner.py")
    with open(runner, "w") as f:
        f.write(TIMM_RUNNER)
    runs = {}
    for name in ("bare", "monitored"):
        out = os.path.join(folder, f"timm-{name}")
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, runner, name, os.path.abspath(args.timm_train), str(args.worker_table), data, "--model", "resnet10t",
               "--img-size", "32", "-b", "32", "--epochs", "2", "-j", "2", "--device", "cpu", "--output", out]
        runs[name] = (cmd, out, env)
    for name, run in watch(runs, args.every).items():
        print(json.dumps(_summary(f"timm {name}", run)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--every", type=float, default=0.25, help="seconds between two USS reads of every worker")
    parser.add_argument("--per-epoch", action="store_true", help="non-persistent workers (imagenet)")
    parser.add_argument("--armed", action="store_true", help="imagenet: the parent's collector close to a full collection")
    parser.add_argument("--timm-train", default="", help="timm's train.py (github.com/huggingface/pytorch-image-models)")
    parser.add_argument("--timm-path", default="", help="a folder timm (and torchvision) are installed in, for PYTHONPATH")
    parser.add_argument("--worker-table", type=int, default=0, help="timm: lists each worker keeps at its start")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "memcallbacks-worker-uss"))
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.every <= 0 or args.worker_table < 0:
        parser.error("--repeat >= 1, --every > 0, --worker-table >= 0")
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as folder:
            imagenet(args, folder, os.path.join(args.data, "imagenet"))
            if args.timm_train:
                timm(args, folder, os.path.join(args.data, "timm"))


if __name__ == "__main__":
    main()
