"""Run-end object gather and the per-step max over ranks, on 2 real gloo ranks (CPU).

``gather_objects`` does its own two ``all_gather`` calls (sizes, then padded bytes) so that under NCCL
its tensors go to the monitored device instead of ``torch.cuda.current_device()``; on gloo they are
CPU tensors and this checks the protocol itself: objects of different sizes, in rank order, on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from helpers import free_port
from memcallbacks._base import distributed

ROOT = Path(__file__).resolve().parents[2]

RANKS = textwrap.dedent('''
    import json, math, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from memcallbacks._base import distributed


    def run(rank, out, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            # rank 1 sends 300 KB, rank 0 a few bytes: the shorter one is padded and cut back
            obj = {"rank": rank, "blob": "x" * (300_000 if rank else 3), "nested": [rank, None, ("t", 1.5)]}
            gathered = distributed.gather_objects(obj, torch.device("cpu"))
            values = [float(rank + 1), math.nan if rank == 0 else 7.0, 10.0 - rank]
            best, holders = distributed.max_over_ranks(values, torch.device("cpu"))
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump({"gathered": gathered, "best": best, "holders": holders}, f)
        finally:
            dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
''')


def test_gather_objects_and_max_over_ranks_on_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    expected = [{"rank": r, "blob": "x" * (300_000 if r else 3), "nested": [r, None, ["t", 1.5]]} for r in range(2)]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["gathered"] == expected, rank
        # max over ranks and the rank holding it; rank 0's NaN means "no value" and never wins
        assert result["best"] == [2.0, 7.0, 10.0] and result["holders"] == [1, 1, 0], result


def test_not_distributed_returns_this_rank_only() -> None:
    assert not distributed.is_distributed()
    assert distributed.gather_objects({"a": 1}, torch.device("cpu")) == [{"a": 1}]
    assert distributed.max_over_ranks([1.0, 2.0]) == ([1.0, 2.0], [0, 0])
