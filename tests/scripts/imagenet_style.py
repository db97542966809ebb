"""An ImageNet-style training script: an ImageFolder of JPEGs decoded with PIL in DataLoader workers.

Run by ``tests/scenarios/test_imagenet_workers.py`` and ``benchmarks/worker_uss.py`` in a process of
its own, so that each worker's private memory (USS) can be read from outside it. The shape of
timm's ``train.py`` and torchvision's reference script, small enough for a 2-core CPU: a folder per
class of generated JPEGs (made once into ``--data``), a ``Dataset`` that keeps ``(path, class)``
pairs in a Python list (as ``torchvision.datasets.ImageFolder`` does) and decodes with PIL in
``__getitem__``, a random crop and flip, a small CNN, ``--workers`` training workers and as many
evaluation workers, an evaluation after every epoch inside ``monitor.evaluate()``.

    python tests/scripts/imagenet_style.py OUT --data DIR [--monitor] [--persistent] [--epochs 3] [--cache]

``--cache``: the Dataset keeps every decoded image in a dict on itself (``self.decoded``), filled
inside each worker: the leak the worker watch must still find. ``--monitor``: a default ``Monitor``
around the loop (without it, the same loop bare). ``--armed``: the parent's collector is left close to a
full collection when the workers start (:func:`arm_collector`), and each worker keeps a small table it
builds at its start (``worker_init_fn``): a bare run's workers then each collect their inherited heap. Writes ``OUT/result.json``: its pid and the monitor's findings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

CLASSES = 10


def make_image_folder(root: str, train: int, val: int, size: int) -> None:
    """``root/{train,val}/class{c}/{i}.jpg``: coloured squares with noise, made once (a marker file says done)."""
    done = os.path.join(root, f".done-{train}-{val}-{size}")
    if os.path.exists(done):
        return
    rng = random.Random(0)
    for split, n in (("train", train), ("val", val)):
        for i in range(n):
            c = i % CLASSES
            folder = os.path.join(root, split, f"class{c}")
            os.makedirs(folder, exist_ok=True)
            pixels = np.random.default_rng(i).integers(0, 64, (size, size, 3), dtype=np.uint8)
            pixels[..., 0] += np.uint8(c * 19)
            pixels[..., 1] += np.uint8(rng.randrange(128))
            Image.fromarray(pixels).save(os.path.join(folder, f"{i}.jpg"), quality=90)
    open(done, "w").close()


class ImageFolderJpeg(Dataset):
    """``torchvision.datasets.ImageFolder``'s layout and sample list, decoded with PIL."""

    def __init__(self, root: str, *, crop: int, train: bool, cache: bool = False) -> None:
        classes = sorted(os.listdir(root))
        self.samples = [(os.path.join(root, c, f), k) for k, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(root, c)))]
        self.crop, self.train, self.cache = crop, train, cache
        self.decoded: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, index: int) -> torch.Tensor:
        path, _ = self.samples[index]
        with Image.open(path) as img:
            pixels = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
        image = torch.from_numpy(pixels).permute(2, 0, 1)
        if self.cache:  # the bug: every worker fills its own copy, for the run with persistent workers
            image = image.repeat(1, 4, 4).contiguous()  # kept larger (160x160), as a resized image would be
            self.decoded[index] = image
        return image

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.decoded.get(index) if self.cache else None
        if image is None:
            image = self._load(index)
        _, h, w = image.shape
        if self.train:
            top, left = random.randrange(h - self.crop + 1), random.randrange(w - self.crop + 1)
            image = image[:, top: top + self.crop, left: left + self.crop]
            if random.random() < 0.5:
                image = image.flip(2)
        else:
            top, left = (h - self.crop) // 2, (w - self.crop) // 2
            image = image[:, top: top + self.crop, left: left + self.crop]
        return (image - 0.5) / 0.25, self.samples[index][1]


ARMED: list[list[int]] = []
TABLE: list[list[int]] = []
MARGIN, TABLE_SIZE = 3_000, 10_000


def arm_collector() -> None:
    """Leave the collector where timm's ``train.py`` left it at its workers' fork, only closer (CPython 3.8-3.13's
    rule for a full collection): the oldest generation's count past its threshold (10), and the objects promoted
    to it since the last full collection :data:`MARGIN` short of a quarter of those that collection kept."""
    gc.collect()
    kept = len(gc.get_objects())
    gc.disable()  # no automatic collection while they are made: explicit ones only
    ARMED.extend([i] for i in range(kept // 4 - MARGIN))
    for _ in range(11):
        gc.collect(1)
    gc.enable()


def build_table(worker_id: int) -> None:
    """``worker_init_fn``: a worker builds a small table at its start (a lookup, an import's objects)."""
    TABLE.extend([i] for i in range(TABLE_SIZE))


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, CLASSES),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--data", required=True)
    p.add_argument("--monitor", action="store_true")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--cache", action="store_true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--train", type=int, default=320)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--size", type=int, default=40)
    p.add_argument("--crop", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pace", type=float, default=0.0, help="seconds of sleep after each step (a device-bound step)")
    p.add_argument("--armed", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    make_image_folder(args.data, args.train, args.val, args.size)
    train_set = ImageFolderJpeg(os.path.join(args.data, "train"), crop=args.crop, train=True, cache=args.cache)
    val_set = ImageFolderJpeg(os.path.join(args.data, "val"), crop=args.crop, train=False)
    common = {"num_workers": args.workers, "persistent_workers": args.persistent, "batch_size": args.batch,
              "worker_init_fn": build_table if args.armed else None}
    train_loader = DataLoader(train_set, shuffle=True, drop_last=True, **common)
    val_loader = DataLoader(val_set, shuffle=False, **common)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    monitor = None
    if args.monitor:
        from memcallbacks import Monitor

        monitor = Monitor(model, optimizer, output_dir=os.path.join(args.out, "memcallbacks"))
    if args.armed:
        arm_collector()
    for epoch in range(args.epochs):
        model.train()
        batches = monitor.track(train_loader) if monitor is not None else train_loader
        for i, (images, labels) in enumerate(batches):
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.pace:
                time.sleep(args.pace)
        model.eval()
        with (monitor.evaluate() if monitor is not None else nullcontext()), torch.no_grad():
            for images, labels in val_loader:
                model(images)
    if monitor is not None:
        monitor.close()
    result = {"pid": os.getpid(), "findings": [f.to_dict() for f in monitor.findings] if monitor is not None else []}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
