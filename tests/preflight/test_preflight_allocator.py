"""The pre-flight's CUDA caching-allocator model against torch's rules (c10/cuda/CUDACachingAllocator.cpp),
and the cuBLAS workspaces it adds per thread that runs matmuls. CPU only: arithmetic and fake steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memcallbacks.preflight import predict
from memcallbacks.preflight.allocator import (
    CachingAllocatorModel,
    allocation_size,
    block_bytes,
    cublas_workspace_bytes,
    replay,
    round_size,
    should_split,
)
from memcallbacks.preflight.workspaces import BACKWARD_THREAD, FORWARD_THREAD, is_matmul

KIB, MIB = 1 << 10, 1 << 20


def test_round_size_pools_and_segments() -> None:
    # round_size: 512-byte multiples in both pools (roundup_power2_divisions off), nothing for 0 bytes
    assert [round_size(n) for n in (0, 1, 512, 513, 11 * MIB + 1)] == [0, 512, 512, 1024, 11 * MIB + 512]
    # get_allocation_size: 2 MiB for the small pool (<= kSmallSize), 20 MiB under kMinLargeAlloc, else 2 MiB rounding
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB) == allocation_size(11 * MIB + 512) == 12 * MIB


def test_should_split_small_pool_at_512_bytes_large_pool_only_above_1_mib() -> None:
    assert should_split(2 * MIB, MIB) and should_split(MIB + 512, MIB)  # small pool: remaining >= kMinBlockSize
    assert not should_split(MIB, MIB) and not should_split(1024, 1024)
    assert should_split(20 * MIB, 5 * MIB)  # large pool: remaining > kSmallSize
    assert not should_split(12 * MIB, 11 * MIB)  # exactly 1 MiB left: not split
    assert not should_split(20 * MIB, 19 * MIB + 512)
    assert should_split(20 * MIB, 19 * MIB - 512)


def test_an_11_mib_tensor_counts_12_mib() -> None:
    assert block_bytes(11 * MIB) == 12 * MIB  # a 12 MiB segment, its 1 MiB remainder not split off
    assert block_bytes(11 * MIB + 1) == 12 * MIB
    assert block_bytes(12 * MIB) == 12 * MIB
    assert block_bytes(19 * MIB + 512 * KIB) == 20 * MIB  # own segment rounded to 2 MiB, 0.5 MiB left: whole
    assert block_bytes(9 * MIB + 512 * KIB) == 9 * MIB + 512 * KIB  # from a 20 MiB segment, 10.5 MiB left: split
    assert block_bytes(5 * MIB) == 5 * MIB
    assert block_bytes(100 * KIB) == 100 * KIB
    assert block_bytes(cublas_workspace_bytes()) == 8 * MIB + 128 * KIB  # 8.125 MiB from a 20 MiB segment
    assert block_bytes(cublas_workspace_bytes(hopper_or_newer=True)) == 32 * MIB


def test_cached_blocks_are_reused_best_fit_counted_whole_and_merged_when_freed() -> None:
    model = CachingAllocatorModel()
    a = model.malloc(5 * MIB)  # a new 20 MiB segment, split: 15 MiB stay cached
    assert a.size == 5 * MIB and (model.allocated, model.reserved) == (5 * MIB, 20 * MIB)
    b = model.malloc(14 * MIB + 512 * KIB)  # the cached 15 MiB block fits; 0.5 MiB left is not split off
    assert b.size == 15 * MIB and (model.allocated, model.reserved) == (20 * MIB, 20 * MIB)
    model.free(a)
    model.free(b)  # merged with its free neighbour: one 20 MiB block again
    c = model.malloc(19 * MIB)  # reuses it whole (1 MiB left), no new segment
    assert c.size == 20 * MIB and model.reserved == 20 * MIB
    small = model.malloc(100 * KIB)  # the small pool: its own 2 MiB segment, split at 512 bytes
    assert small.size == 100 * KIB and model.reserved == 22 * MIB and model.peak_allocated == 20 * MIB + 100 * KIB
    d = model.malloc(3 * MIB)  # nothing cached fits in the large pool: a new 20 MiB segment
    assert d.size == 3 * MIB and model.peak_reserved == 42 * MIB


def test_replay_counts_each_record_by_its_block_and_injects_the_workspaces() -> None:
    events = [(0, 1), (1, 1), (0, -1), (2, 1)]
    sizes = [11 * MIB, 100, 11 * MIB]
    rep = replay(events, sizes, {2: [cublas_workspace_bytes(True)]})
    assert rep.record_bytes == [12 * MIB, 512, 12 * MIB]  # the freed 12 MiB block serves the second 11 MiB tensor
    assert rep.extra_bytes == {2: [32 * MIB]}
    assert rep.peak_reserved == 12 * MIB + 2 * MIB + 32 * MIB


def test_predicted_cuda_blocks_follow_the_rules_and_cpu_stays_exact() -> None:
    # a weight of 1408 x 2048 fp32 = 11 MiB exactly: 12 MiB on CUDA (weight and its gradient), 11 MiB on CPU
    model = nn.Sequential(nn.Linear(1408, 2048, bias=False), nn.ReLU(), nn.Linear(2048, 4, bias=False))
    batch = (torch.empty(8, 1408, device="meta"), torch.empty(8, dtype=torch.long, device="meta"))
    cpu = predict(model, batch, "sgd", loss_fn=F.cross_entropy, device="cpu")
    cuda = predict(model, batch, "sgd", loss_fn=F.cross_entropy, device="cuda")
    small = 2048 * 4 * 4
    assert cpu.breakdown["forward"]["params"] == 11 * MIB + small
    assert cuda.breakdown["forward"]["params"] == 12 * MIB + small
    assert cuda.breakdown["backward"]["grads"] == 12 * MIB + small
    assert "workspace" not in cpu.breakdown["forward"]


def test_one_workspace_per_thread_that_runs_matmuls() -> None:
    ws = cublas_workspace_bytes(hopper_or_newer=True)
    assert is_matmul("aten.addmm.default") and is_matmul("aten.mm.default") and not is_matmul("aten.relu.default")
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    batch = (torch.empty(16, 64, device="meta"), torch.empty(16, dtype=torch.long, device="meta"))
    p = predict(model, batch, "adamw", loss_fn=F.cross_entropy, device="cuda", hopper=True)
    first = p.first_step
    # first step: the forward thread's from its first matmul, the autograd device thread's from backward's
    assert first.breakdown["forward"]["workspace"] == ws
    assert first.breakdown["backward"]["workspace"] == first.breakdown["optimizer"]["workspace"] == 2 * ws
    assert first.start_bytes < ws
    # steady step: both alive from the start
    assert all(cats["workspace"] == 2 * ws for cats in p.breakdown.values()) and p.start_bytes > 2 * ws
    assert FORWARD_THREAD in p.notes[-1] and BACKWARD_THREAD in p.notes[-1]


def test_backward_without_a_matmul_keeps_one_workspace() -> None:
    """A frozen first layer and an elementwise trainable scale: forward runs a matmul, backward none."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(64, 32)
            self.frozen.requires_grad_(False)
            self.scale = nn.Parameter(torch.ones(32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.frozen(x) * self.scale

    batch = (torch.empty(16, 64, device="meta"), torch.empty(16, dtype=torch.long, device="meta"))
    p = predict(Scaled(), batch, "sgd", loss_fn=F.cross_entropy, device="cuda")
    assert all(cats["workspace"] == cublas_workspace_bytes() for cats in p.breakdown.values())
    assert BACKWARD_THREAD not in p.notes[-1]
