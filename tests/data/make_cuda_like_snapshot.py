"""Build ``cuda_like_snapshot.pickle``: a small snapshot in the exact format of a real CUDA one, made by hand.

It was NOT recorded on a GPU. It follows what ``torch.cuda.memory._snapshot()`` returns in torch
2.13 (``torch/csrc/cuda/Module.cpp``, ``_memorySnapshot``): top-level ``segments``,
``device_traces``, ``allocator_settings`` and ``external_annotations``; segments with ``device``,
``address``, ``total_size``, ``allocated_size``, ``active_size``, ``requested_size``, ``stream``,
``segment_type``, ``segment_pool_id``, ``is_expandable``, ``frames`` and ``blocks`` (each with
``address``, ``size``, ``requested_size``, ``state``, ``frames``); trace entries with ``action``,
``addr`` (``device_free`` for ``oom``), ``size``, ``stream``, ``time_us`` and ``frames`` (Python
stacks only, innermost first, as with ``stacks="python"``). A toy caching allocator below keeps
the blocks, segments and trace consistent (2 MiB small segments, 20 MiB segments for 1-10 MiB
blocks, 512-byte-rounded blocks, splitting and merging, ``empty_cache``), like the real one.

The story: a linear model trains three steps on cuda:0. Its parameters were allocated before
history was turned on (blocks without frames, no ``alloc`` entries). Each step allocates the
batch, activations, gradients; the first step creates Adam's state. In step 2 ``train.py:55``
appends a 32 MiB buffer to a list and never frees it. A tensor freed on a side stream is still
``active_pending_free`` at the end. Step 1 uses an 18 MiB workspace once and ``empty_cache()``
returns its segment. Step 3 asks for 80 GiB and runs out of memory.

Run ``python tests/data/make_cuda_like_snapshot.py`` to rebuild the file (deterministic).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

MIB = 2**20
SMALL = 1 * MIB  # requests up to this size come from 2 MiB "small" segments
BASE = 0x7F3A_0000_0000
TORCH = "/opt/conda/lib/python3.11/site-packages/torch"
TRAIN = "/home/alice/proj/train.py"
MODEL = "/home/alice/proj/model.py"


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


MAIN = [frame(TRAIN, 90, "main"), frame(TRAIN, 98, "<module>")]


def step_frames(line: int) -> list[dict[str, Any]]:
    return [frame(TRAIN, line, "train_step"), *MAIN]


def in_forward(line: int) -> list[dict[str, Any]]:
    return [
        frame(f"{TORCH}/nn/modules/linear.py", 125, "forward"),
        frame(f"{TORCH}/nn/modules/module.py", 1762, "_call_impl"),
        frame(MODEL, line, "forward"),
        frame(f"{TORCH}/nn/modules/module.py", 1762, "_call_impl"),
        *step_frames(44),
    ]


BACKWARD = [
    frame(f"{TORCH}/autograd/graph.py", 829, "_engine_run_backward"),
    frame(f"{TORCH}/autograd/__init__.py", 347, "backward"),
    frame(f"{TORCH}/_tensor.py", 648, "backward"),
    *step_frames(47),
]
ADAM = [
    frame(f"{TORCH}/optim/adam.py", 178, "_init_group"),
    frame(f"{TORCH}/optim/adam.py", 238, "step"),
    frame(f"{TORCH}/optim/optimizer.py", 493, "wrapper"),
    *step_frames(48),
]


class ToyAllocator:
    """Just enough of the CUDA caching allocator to produce a consistent snapshot."""

    def __init__(self) -> None:
        self.segments: list[dict[str, Any]] = []
        self.trace: list[dict[str, Any]] = []
        self.time_us = 1_760_000_000_000_000
        self.next_address = BASE
        self.recording = False

    def record(self, entry: dict[str, Any]) -> None:
        self.time_us += 137
        if self.recording:
            entry = {**entry, "stream": entry.get("stream", 0), "time_us": self.time_us}
            self.trace.append(entry)

    def new_segment(self, size: int, small: bool, frames: list[dict[str, Any]]) -> dict[str, Any]:
        # as the real allocator: 2 MiB for small blocks, 20 MiB for 1-10 MiB ones, else rounded up to 2 MiB
        total = 2 * MIB if small else 20 * MIB if size < 10 * MIB else -(-size // (2 * MIB)) * 2 * MIB
        seg = {
            "device": 0, "address": self.next_address, "total_size": total, "stream": 0,
            "segment_type": "small" if small else "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": frames if self.recording else [],
            "blocks": [{"size": total, "requested_size": 0, "state": "inactive", "frames": []}],
        }
        self.next_address += 0x1000_0000  # cudaMalloc hands out far-apart ranges
        self.segments.append(seg)
        self.record({"action": "segment_alloc", "addr": seg["address"], "size": total, "frames": frames})
        return seg

    def malloc(self, requested: int, frames: list[dict[str, Any]]) -> int:
        size = -(-requested // 512) * 512
        small = requested <= SMALL
        for seg in self.segments:
            if (seg["segment_type"] == "small") != small:
                continue
            addr = seg["address"]
            for i, b in enumerate(seg["blocks"]):
                if b["state"] == "inactive" and b["size"] >= size:
                    rest = b["size"] - size
                    seg["blocks"][i] = {"size": size, "requested_size": requested, "state": "active_allocated",
                                        "frames": frames if self.recording else []}
                    if rest:
                        seg["blocks"].insert(i + 1, {"size": rest, "requested_size": 0, "state": "inactive", "frames": []})
                    self.record({"action": "alloc", "addr": addr, "size": requested, "frames": frames})
                    return addr
                addr += b["size"]
        self.new_segment(size, small, frames)
        return self.malloc(requested, frames)

    def find(self, addr: int) -> tuple[dict[str, Any], int]:
        for seg in self.segments:
            a = seg["address"]
            for i, b in enumerate(seg["blocks"]):
                if a == addr:
                    return seg, i
                a += b["size"]
        raise KeyError(addr)

    def free_requested(self, addr: int, frames: list[dict[str, Any]]) -> None:
        seg, i = self.find(addr)
        b = seg["blocks"][i]
        b["state"] = "active_pending_free"
        self.record({"action": "free_requested", "addr": addr, "size": b["requested_size"], "frames": frames})

    def free_completed(self, addr: int, frames: list[dict[str, Any]]) -> None:
        seg, i = self.find(addr)
        b = seg["blocks"][i]
        self.record({"action": "free_completed", "addr": addr, "size": b["requested_size"], "frames": frames})
        seg["blocks"][i] = {"size": b["size"], "requested_size": 0, "state": "inactive", "frames": []}
        blocks = seg["blocks"]
        j = 0
        while j + 1 < len(blocks):  # merge neighbouring free blocks
            if blocks[j]["state"] == "inactive" and blocks[j + 1]["state"] == "inactive":
                blocks[j]["size"] += blocks.pop(j + 1)["size"]
            else:
                j += 1

    def free(self, addr: int, frames: list[dict[str, Any]]) -> None:
        self.free_requested(addr, frames)
        self.free_completed(addr, frames)

    def empty_cache(self) -> None:
        for seg in list(self.segments):
            if all(b["state"] == "inactive" for b in seg["blocks"]):
                self.segments.remove(seg)
                self.record({"action": "segment_free", "addr": seg["address"], "size": seg["total_size"], "frames": []})

    def oom(self, requested: int, device_free: int, frames: list[dict[str, Any]]) -> None:
        self.record({"action": "oom", "device_free": device_free, "size": requested, "frames": frames})

    def snapshot(self) -> dict[str, Any]:
        segments = []
        for seg in self.segments:
            addr = seg["address"]
            blocks = []
            for b in seg["blocks"]:
                blocks.append({"address": addr, "size": b["size"], "requested_size": b["requested_size"],
                               "state": b["state"], "frames": b["frames"]})
                addr += b["size"]
            active = [b for b in blocks if b["state"] != "inactive"]
            segments.append({
                "device": seg["device"], "address": seg["address"], "total_size": seg["total_size"],
                "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                "active_size": sum(b["size"] for b in active),
                "requested_size": sum(b["requested_size"] for b in active),
                "stream": seg["stream"], "segment_type": seg["segment_type"], "segment_pool_id": seg["segment_pool_id"],
                "is_expandable": seg["is_expandable"], "frames": seg["frames"], "blocks": blocks,
            })
        return {
            "segments": segments,
            "device_traces": [self.trace],
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
                "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {str(2**i): 0 for i in range(64)},
            },
            "external_annotations": [],
        }


LEAK_LINE = 55
"""``train.py`` line of the 32 MiB buffer that stays alive."""


def build() -> dict[str, Any]:
    a = ToyAllocator()
    # parameters and their Adam state were created before history was turned on
    weights = [a.malloc(4 * MIB, []), a.malloc(4 * MIB, [])]
    biases = [a.malloc(4096, []), a.malloc(4096, [])]
    a.recording = True
    cache = []
    side_stream_free = None
    for step in range(3):
        batch = a.malloc(1 * MIB + 4096, step_frames(42))  # just over 1 MiB: a large block
        hidden = a.malloc(4 * MIB, in_forward(21))
        out = a.malloc(64 * 1024, in_forward(23))
        loss = a.malloc(4, [frame(f"{TORCH}/nn/functional.py", 3494, "cross_entropy"), *step_frames(45)])
        grads = [a.malloc(4 * MIB, BACKWARD), a.malloc(4 * MIB, BACKWARD), a.malloc(4096, BACKWARD), a.malloc(4096, BACKWARD)]
        a.free(out, BACKWARD)
        a.free(hidden, BACKWARD)
        if step == 0:
            state = [a.malloc(4 * MIB, ADAM) for _ in range(4)]
        if step == 1:
            cache.append(a.malloc(32 * MIB, step_frames(LEAK_LINE)))  # the leak
        for g in grads:
            a.free(g, step_frames(49))
        a.free(loss, step_frames(50))
        if step < 2:
            a.free(batch, step_frames(51))
        else:  # freed by Python, in use on a side stream until an event completes
            side_stream_free = batch
            a.free_requested(batch, step_frames(51))
        if step == 0:
            scratch = a.malloc(18 * MIB, in_forward(25))  # a one-off 18 MiB workspace: its own segment
            a.free(scratch, in_forward(25))
            a.empty_cache()  # hands the workspace's segment back: a segment_free entry
    a.oom(80 * 2**30, 1 * 2**30, [frame(TRAIN, 60, "train_step"), *MAIN])
    del state, weights, biases, side_stream_free
    return a.snapshot()


def main() -> Path:
    path = Path(__file__).with_name("cuda_like_snapshot.pickle")
    with open(path, "wb") as fh:
        pickle.dump(build(), fh, protocol=4)
    return path


if __name__ == "__main__":
    print(main())
