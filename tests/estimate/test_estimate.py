"""Tests for memcallbacks.estimate and the ``memcallbacks estimate`` command: real models, real optimizers, real numbers."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import run_ranks
from memcallbacks.cli import estimate as _estimate_cli
from memcallbacks.estimate import (
    GB,
    GiB,
    MemoryEstimate,
    compare,
    estimate,
    estimate_for,
    estimate_grid,
    find_layers,
    measure_model_states,
)

# ---------------------------------------------------------------------------------------------
# seed 000: 4 layers x 1B params, Adam, FSDP2 full shard on 8 ranks, bf16 mixed precision


def test_seed_000_worked_example_in_decimal_gigabytes() -> None:
    e = estimate(
        num_params=4e9, largest_layer_params=1e9, optimizer="adam", precision="bf16-mixed", strategy="fsdp2", world_size=8
    )
    # GB = 1e9: the seed's "1B params x 2 bytes = 2G" arithmetic only closes in decimal units
    assert (e.device_params, e.device_optimizer, e.device_grads) == (2 * GB, 4 * GB, 2 * GB)
    assert e.device_steady == 6 * GB  # sharded fp32 params + sharded Adam moments; grads come and go
    assert e.device_params + e.device_grads + e.device_optimizer == 8 * GB  # "8G per rank" with grads
    assert e.device_forward_peak == 10 * GB  # + 2 x one layer's full bf16 params (current + prefetched)
    assert e.device_backward_peak == 12 * GB  # + 2 x layer grads (bf16) + 1 x layer weights (bf16)
    assert e.device_peak == 12 * GB
    assert (e.host_steady, e.host_init) == (0, 0)


def test_seed_000_unsharded_fp32_is_64_gb_and_bf16_mixed_does_not_shrink_the_steady_state() -> None:
    single = estimate(num_params=4e9, optimizer="adam", precision="fp32", strategy="single")
    assert single.device_params + single.device_grads + single.device_optimizer == 64 * GB  # 16 + 16 + 32
    fp32 = estimate(num_params=4e9, largest_layer_params=1e9, precision="32-true", strategy="fsdp2", world_size=8)
    mixed = estimate(num_params=4e9, largest_layer_params=1e9, precision="bf16-mixed", strategy="fsdp2", world_size=8)
    assert fp32.device_steady == mixed.device_steady == 6 * GB
    assert fp32.device_forward_peak == 6 * GB + 2 * 4 * GB  # fp32 gathers cost twice as much


def test_seed_000_from_a_meta_model_with_four_one_billion_parameter_layers() -> None:
    class FourLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(100_000, 10_000, bias=False) for _ in range(4))

    with torch.device("meta"):
        model = FourLayers()
    assert find_layers(model) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    e = estimate(model, optimizer="adam", precision="bf16-mixed", strategy="fsdp2", world_size=8)
    assert (e.num_params, e.layer_params, e.root_params) == (4 * 10**9, 10**9, 0)
    assert e.device_steady == 6 * GB
    assert (e.device_forward_peak, e.device_backward_peak) == (10 * GB, 12 * GB)
    assert e.host_optimizer == 4 * 4  # torch's Adam keeps a float32 'step' per tensor on the CPU


def test_seed_000_conservative_accounting_adds_backward_prefetch_and_reduced_grad_shards() -> None:
    e = estimate(
        num_params=4e9, largest_layer_params=1e9, precision="bf16-mixed", strategy="fsdp2", world_size=8, conservative=True
    )
    assert e.device_backward_peak == 12 * GB + 2 * GB + 2 * GB
    assert e.device_forward_peak == 10 * GB


# ---------------------------------------------------------------------------------------------
# DeepSpeed's estimators, transcribed from microsoft/DeepSpeed@38327e07f6cd39b63418f60cedd1651b0be3e7c3
# deepspeed/runtime/zero/stage_1_and_2.py and deepspeed/runtime/zero/stage3.py (not imported: no deepspeed here)


def ds_estimate_zero2_model_states_mem_needs(
    total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5
):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_estimate_zero3_model_states_mem_needs(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
):
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# (total params, largest layer params, gpus per node, nodes): seed 000's model, OPT-6.7b on 7 GPUs
# (seed 004; largest module = the 50272 x 4096 embedding), a 7B model on 2 nodes, a 70B model on 4 nodes
DS_CASES = [
    (4_000_000_000, 1_000_000_000, 8, 1),
    (6_658_473_984, 205_914_112, 7, 1),
    (7_000_000_000, 131_072_000, 8, 2),
    (70_000_000_000, 1_050_673_152, 8, 4),
]
BUFFER_FACTOR = 1.5


def _bytes_close(ours: float, theirs: float) -> bool:
    # DeepSpeed int()-truncates float products; we round each per-rank component to a byte and
    # multiply by ranks per node and the buffer factor: a few tens of bytes apart at most
    return abs(ours - theirs) <= 64


@pytest.mark.parametrize("total,largest,gpus_per_node,nodes", DS_CASES)
@pytest.mark.parametrize("cpu_offload", [True, False])
def test_zero2_agrees_with_deepspeed_estimator(total, largest, gpus_per_node, nodes, cpu_offload) -> None:
    ds_cpu, ds_gpu = ds_estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload, BUFFER_FACTOR)
    world = gpus_per_node * nodes
    e = estimate(
        num_params=total,
        optimizer="adam",
        precision="16-mixed",
        strategy="zero2",
        world_size=world,
        ranks_per_node=gpus_per_node,
        offload_optimizer=cpu_offload,
        reduce_bucket_size=0,  # DeepSpeed's estimator leaves the reduce bucket out
    )
    assert _bytes_close(e.device_peak, ds_gpu)  # 2P fp16 params (+ 18P/N: fp16+fp32 grad, fp32 master, 2 moments)
    ours_cpu = e.host_peak_per_node * BUFFER_FACTOR
    if nodes == 1 or not cpu_offload:
        assert _bytes_close(ours_cpu, ds_cpu)
    else:
        # documented difference: DeepSpeed puts every rank of every node on one host (4 x total_gpus)
        # and does not divide the 16 B/param of offloaded state by the node count
        assert _bytes_close(ours_cpu, total * max(4 * gpus_per_node, 16 / nodes) * BUFFER_FACTOR)
        assert ours_cpu < ds_cpu


@pytest.mark.parametrize("total,largest,gpus_per_node,nodes", DS_CASES)
@pytest.mark.parametrize(
    "cpu_offload,cpu_offload_params", [(True, True), (True, False), (False, False)], ids=["offload_both", "offload_opt", "no_offload"]
)
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_agrees_with_deepspeed_estimator(total, largest, gpus_per_node, nodes, cpu_offload, cpu_offload_params, zero_init) -> None:
    ds_cpu, ds_gpu, ds_layer = ds_estimate_zero3_model_states_mem_needs(
        total, largest, gpus_per_node, nodes, cpu_offload, cpu_offload_params, zero_init, BUFFER_FACTOR
    )
    world = gpus_per_node * nodes
    e = estimate(
        num_params=total,
        largest_layer_params=largest,
        optimizer="adam",
        precision="bf16-mixed",
        strategy="zero3",
        world_size=world,
        ranks_per_node=gpus_per_node,
        offload_optimizer=cpu_offload,
        offload_param=cpu_offload_params,
        zero_init=zero_init,
        reduce_bucket_size=0,
    )
    assert e.device_backward_working == ds_layer  # 2 B gathered layer params + 2 B its grads
    grad_partition = 2 * total / world  # stage3.py's grad_partitions_flat_buffer, not in DeepSpeed's sum
    if cpu_offload:
        assert _bytes_close(e.device_peak, ds_gpu)
        if zero_init:
            assert _bytes_close(e.host_peak_per_node * BUFFER_FACTOR, ds_cpu + grad_partition * gpus_per_node * BUFFER_FACTOR)
        else:
            steady = (20 if cpu_offload_params else 18) * total / world
            assert _bytes_close(e.host_peak_per_node * BUFFER_FACTOR, gpus_per_node * max(4 * total, steady) * BUFFER_FACTOR)
    else:
        # DeepSpeed: 18P/N + 4L all at once; we: 16P/N persistent (2 params + 2 grad buffer + 12 Adam
        # and master) plus either the working set (backward) or the fp32 grad copy (step)
        assert _bytes_close(e.device_peak, 16 * total / world + max(4 * largest, 4 * total / world))
        assert _bytes_close(e.device_peak, ds_gpu - 2 * total / world - 4 * largest + max(4 * largest, 4 * total / world))
        assert _bytes_close(e.host_peak_per_node * BUFFER_FACTOR, ds_cpu)  # the full or per-layer fp32 copy at init


def test_zero_reduce_bucket_counts_by_default_and_accumulation_keeps_zero2_partitions() -> None:
    base = dict(num_params=7e9, precision="bf16-mixed", strategy="zero2", world_size=8)
    with_bucket = estimate(**base)
    without = estimate(**base, reduce_bucket_size=0)
    assert with_bucket.device_comm_buffers == 500_000_000 * 2
    assert with_bucket.device_steady - without.device_steady == 10**9
    accum = estimate(**base, gradient_accumulation_steps=4)
    assert accum.device_forward_peak - with_bucket.device_forward_peak == 2 * 7e9 / 8  # fp16 grad partition


# ---------------------------------------------------------------------------------------------
# seed 004: ZeRO-3 param offload on 7 GPUs saves params x 2 bytes / world size


def opt_params(hidden: int, layers: int, ffn: int, vocab: int = 50272, positions: int = 2048) -> int:
    """OPT decoder parameters (lm_head tied to the embedding), as transformers' OPTForCausalLM builds it."""
    per_layer = 4 * (hidden * hidden + hidden) + (hidden * ffn + ffn) + (ffn * hidden + hidden) + 2 * 2 * hidden
    return layers * per_layer + vocab * hidden + (positions + 2) * hidden + 2 * hidden


@pytest.mark.parametrize(
    "name,params,measured_gib,seed_expected_gb",
    [("opt-6.7b", opt_params(4096, 32, 16384), 1.82, 1.9), ("opt-13b", opt_params(5120, 40, 20480), 3.49, 3.7)],
)
def test_seed_004_param_offload_saving(name, params, measured_gib, seed_expected_gb) -> None:
    assert params in (6_658_473_984, 12_853_473_280)  # the counts transformers gives for these configs
    common = dict(num_params=params, largest_layer_params=50272 * 4096, precision="16-mixed", strategy="zero3", world_size=7)
    kept = estimate(**common, offload_optimizer=True)
    offloaded = estimate(**common, offload_optimizer=True, offload_param=True)
    saving = kept.device_steady - offloaded.device_steady
    assert saving == kept.device_peak - offloaded.device_peak == round(2 * params / 7)
    assert offloaded.host_params == saving  # moved, not lost
    # the seed's expectation (nominal size x 2 / 7, in 1e9 bytes, one decimal) - our exact count agrees
    assert abs(saving / GB - seed_expected_gb) <= 0.05
    # the measurement: DeepSpeed's see_memory_usage prints GiB (2**30) with two decimals. Rounding
    # allows +-0.01 GiB; both models measure 2-3% above 2P/N (1.82 vs 1.77, 3.49 vs 3.42 GiB), a
    # systematic offset of DeepSpeed-Chat's setup the seed does not explain. Tolerance: 3%.
    assert abs(saving / GiB - measured_gib) / measured_gib <= 0.03


# ---------------------------------------------------------------------------------------------
# exact bytes for live CPU models after one optimizer step


class Tiny(nn.Module):
    """Embedding tied to the output head, a frozen layer, a bias-less conv: every counting corner."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)) for _ in range(2)])
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 6, kernel_size=3, padding=1, bias=False)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        x = self.conv(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return self.head(self.frozen(x))


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()
    optimizer.step()


OPTIMIZER_FACTORIES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd+momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "adamw+amsgrad": lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    "adam+amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps),
    "rmsprop+momentum": lambda ps: torch.optim.RMSprop(ps, momentum=0.9),
    "rmsprop+momentum+centered": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),
}


@pytest.mark.parametrize("name", list(OPTIMIZER_FACTORIES))
def test_measured_equals_estimated_after_one_step_fp32(name: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = OPTIMIZER_FACTORIES[name]([p for p in model.parameters() if p.requires_grad])
    _one_step(model, optimizer)
    measured = measure_model_states(model, optimizer)
    est = estimate_for(model, optimizer)
    assert (est.strategy, est.precision, est.optimizer) == ("single", "fp32", name)
    assert {k: measured[k] for k in ("params", "grads", "optimizer")} == {
        k: est.expected_measurement()[k] for k in ("params", "grads", "optimizer")
    }
    # the name alone gives the same numbers as the live optimizer
    by_name = estimate(model, optimizer=name)
    assert by_name.expected_measurement() == est.expected_measurement()
    # hand count: 6*11 tied + 2*(6*10+10+10*6+6) + 12 + 6*6*3 + 42 frozen = 500 elements, 458 trainable
    assert measured["params"] == 500 * 4 and measured["grads"] == 458 * 4


def test_adam_step_is_a_float32_scalar_on_the_cpu_per_parameter_tensor() -> None:
    model = Tiny()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    _one_step(model, optimizer)
    steps = [s["step"] for s in optimizer.state.values()]
    assert all(t.dtype == torch.float32 and t.dim() == 0 and t.device.type == "cpu" for t in steps)
    est = estimate_for(model, optimizer)
    tensors = len(steps)  # 12 trainable tensors (the tied weight once)
    assert est.host_optimizer == 4 * tensors
    assert est.device_optimizer == 2 * 458 * 4


def test_bf16_true_and_param_groups_with_different_settings() -> None:
    model = Tiny().to(torch.bfloat16)
    decay = [model.embed.weight, *model.blocks.parameters()]
    rest = [model.norm.weight, model.norm.bias, model.conv.weight]
    optimizer = torch.optim.SGD([{"params": decay, "momentum": 0.9}, {"params": rest}], lr=0.1)
    _one_step(model, optimizer)
    measured = measure_model_states(model, optimizer)
    est = estimate_for(model, optimizer)
    assert est.precision == "bf16-true"
    assert measured["optimizer"] == est.expected_measurement()["optimizer"] == 2 * (66 + 2 * 136)  # momentum, group 1
    assert measured["total"] == est.expected_measurement()["total"]


def test_param_outside_the_optimizer_gets_a_grad_but_no_state() -> None:
    model = Tiny()
    optimizer = torch.optim.Adam(model.blocks.parameters())
    _one_step(model, optimizer)
    measured = measure_model_states(model, optimizer)
    expected = estimate_for(model, optimizer).expected_measurement()
    assert measured["optimizer"] == expected["optimizer"] == 2 * 4 * 272 + 4 * 8
    assert measured["grads"] == expected["grads"] == 458 * 4


def test_measure_counts_shared_storage_once_and_skips_meta() -> None:
    flat = torch.zeros(30)
    model = nn.Linear(5, 5)
    with torch.no_grad():
        model.weight.grad = flat[:25].view(5, 5)
        model.bias.grad = flat[25:]
    assert measure_model_states(model)["grads"] == 30 * 4
    with torch.device("meta"):
        meta = nn.Linear(1000, 1000)
    assert measure_model_states(meta)["total"] == 0


# ---------------------------------------------------------------------------------------------
# arithmetic of the strategies


def test_ddp_buckets_are_a_second_copy_of_the_grads_unless_bucket_views() -> None:
    copy = estimate(num_params=1e9, strategy="ddp", world_size=4, optimizer="sgd")
    view = estimate(num_params=1e9, strategy="ddp", world_size=4, optimizer="sgd", gradient_as_bucket_view=True)
    assert copy.device_comm_buffers == 4 * GB and copy.device_steady == 8 * GB
    assert copy.device_backward_peak == 12 * GB
    assert view.device_comm_buffers == 0 and view.device_steady == view.device_backward_peak == 8 * GB


def test_mixed_precision_on_one_device_keeps_no_persistent_low_precision_copy() -> None:
    fp32 = estimate(num_params=1e9, largest_layer_params=1e8, precision="fp32")
    mixed = estimate(num_params=1e9, largest_layer_params=1e8, precision="bf16-mixed")
    assert mixed.device_steady == fp32.device_steady == 12 * GB
    assert mixed.device_forward_peak - mixed.device_steady == 2 * GB  # autocast's transient bf16 casts
    true = estimate(num_params=1e9, precision="bf16-true")
    assert true.device_steady == 6 * GB


def test_fsdp_hybrid_grad_op_offload_and_no_sync() -> None:
    base = dict(num_params=8e9, largest_layer_params=1e9, precision="bf16-mixed", strategy="fsdp2", world_size=64)
    hybrid = estimate(**base, sharding="hybrid", shard_group_size=8)
    assert hybrid.shard_size == 8 and hybrid.device_steady == 12 * 8e9 / 8
    grad_op = estimate(**base, sharding="grad_op")
    assert grad_op.device_forward_working == 2 * 8e9  # every unit stays unsharded until backward
    offload = estimate(**base, offload_param=True)
    assert offload.device_steady == 0 and offload.host_steady == 12 * 8e9 / 64  # grads come and go
    assert offload.host_peak == (4 + 4 + 8 + 4) * 8e9 / 64  # + grads and Adam's foreach temporary at step
    sync = estimate(**base, gradient_accumulation_steps=4)
    no_sync = estimate(**base, gradient_accumulation_steps=4, no_sync=True)
    assert sync.device_forward_peak - estimate(**base).device_forward_peak == 4 * 8e9 / 64  # fp32 grad shards
    assert no_sync.device_forward_peak - estimate(**base).device_forward_peak == 2 * 8e9  # unsharded bf16 grads


def test_zero3_default_unit_is_deepspeeds_largest_module() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 1000))
    assert estimate(model, strategy="zero3", world_size=2).layer_params == 64 * 1000 + 1000
    assert estimate(model, strategy="fsdp2", world_size=2).layer_params == 64 * 1000 + 1000
    assert estimate(model, strategy="fsdp2", world_size=2, layer_cls=nn.Linear).root_params == 64_000


def test_to_frame_and_compare_tables() -> None:
    grid = estimate_grid(
        num_params=4e9, largest_layer_params=1e9, precision="bf16-mixed", strategies=["single", "fsdp2", "zero3"], world_sizes=[8, 16]
    )
    assert [e.label for e in grid] == ["single x1", "fsdp2 x8", "fsdp2 x16", "zero3 x8", "zero3 x16"]
    table = compare(grid, unit="GB")
    assert table.loc["device/steady (GB)", "fsdp2 x8"] == 6.0
    assert table.loc["device/backward_peak (GB)", "fsdp2 x8"] == 12.0
    frame = grid[1].to_frame("GB")
    assert frame.loc["forward_peak", "device"] == 10.0 and list(frame.columns) == ["device", "host"]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(num_params=1e9, strategy="fsdp3"), "strategy='fsdp3' is not one of 'single', 'ddp'"),
        (dict(num_params=1e9, precision="fp8"), "precision='fp8' is not one of"),
        (dict(num_params=1e9, optimizer="lion"), "optimizer='lion' is not one of"),
        (dict(num_params=1e9, optimizer="adam+nesterov"), "unknown flag(s) ['nesterov']"),
        (dict(num_params=1e9, optimizer=-1.0), "optimizer=-1.0 is not a valid number"),
        (dict(num_params=1e9, strategy="fsdp2", world_size=8), "largest_layer_params=None is required"),
        (dict(num_params=1e9, strategy="ddp", world_size=0), "world_size=0 must be an integer >= 1"),
        (dict(num_params=1e9, strategy="single", world_size=8), "pass world_size=1 or strategy='ddp'"),
        (dict(num_params=1e9, largest_layer_params=1, strategy="fsdp", world_size=8, sharding="hybrid"), "shard_group_size=None is required"),
        (dict(num_params=1e9, largest_layer_params=1, strategy="fsdp", world_size=8, sharding="hybrid", shard_group_size=3), "does not divide"),
        (dict(num_params=1e9, strategy="ddp", world_size=2, offload_param=True), "offload_param=True applies to"),
        (dict(num_params=1e9, largest_layer_params=1, strategy="fsdp2", world_size=2, offload_optimizer=True), "pass offload_param=True"),
        (dict(num_params=0), "num_params=0 is not a valid parameter count"),
        (dict(num_params=1e9, strategy="zero2", world_size=2, sharding="grad_op"), "applies to strategy='fsdp'/'fsdp2' only"),
    ],
)
def test_invalid_inputs_name_the_parameter_value_and_fix(kwargs, needle) -> None:
    with pytest.raises(ValueError) as info:
        estimate(**kwargs)
    assert needle in str(info.value)
    assert str(info.value).startswith("estimate(): ")


def test_unknown_optimizer_instance_asks_for_bytes_per_param() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizer='Adamax' is not modelled .* pass optimizer=<bytes"):
        estimate(model, optimizer=torch.optim.Adamax(model.parameters()))
    assert estimate(model, optimizer=8.0).device_optimizer == 6 * 8


# ---------------------------------------------------------------------------------------------
# two real processes on CPU with gloo: DDP (both bucket modes) and FSDP2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results: dict[str, dict] = {}
    try:
        for view in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(13, 17), nn.ReLU(), nn.Linear(17, 5), nn.Linear(5, 3))
            net[3].requires_grad_(False)
            ddp = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
            optimizer = torch.optim.Adam(p for p in ddp.parameters() if p.requires_grad)
            ddp(torch.randn(4, 13)).sum().backward()
            optimizer.step()
            est = estimate_for(ddp, optimizer, gradient_as_bucket_view=view)
            buckets = sum(int(b) for b in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(",") if b)
            results[f"ddp_view={view}"] = {
                "measured": measure_model_states(ddp, optimizer),
                "expected": est.expected_measurement(),
                "strategy": est.strategy,
                "world_size": est.world_size,
                "buckets": buckets,
                "device_comm_buffers": est.device_comm_buffers,
                "device_grads": est.device_grads,
            }
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 9), nn.Linear(9, 3))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 13)).sum().backward()
        optimizer.step()
        est = estimate_for(model, optimizer)
        results["fsdp2"] = {
            "measured": measure_model_states(model, optimizer),
            "expected": est.expected_measurement(),
            "strategy": est.strategy,
            "world_size": est.world_size,
            "layer_params": est.layer_params,
        }
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist")
    run_ranks(_distributed_worker, (2, _free_port(), str(out)), start_method="spawn")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("view", [False, True])
def test_ddp_two_ranks_gloo_measured_equals_estimated(distributed_results, view) -> None:
    for rank_result in distributed_results:
        r = rank_result[f"ddp_view={view}"]
        assert (r["strategy"], r["world_size"]) == ("ddp", 2)
        for key in ("params", "grads", "optimizer"):
            assert r["measured"][key] == r["expected"][key], key
        # params 13*17+17 + 17*5+5 trainable, 5*3+3 frozen; Adam: 2 fp32 moments + 4-byte steps
        assert r["measured"]["params"] == (328 + 18) * 4
        assert r["measured"]["optimizer"] == 2 * 328 * 4 + 4 * 4
        # the reducer's buckets hold every trainable gradient: a copy, or the grads themselves
        assert r["buckets"] == 328 * 4
        if view:
            assert r["device_comm_buffers"] == 0 and r["device_grads"] == r["buckets"]
        else:
            assert r["device_comm_buffers"] == r["buckets"]


@pytest.mark.slow
def test_fsdp2_two_ranks_gloo_sharded_bytes_per_rank(distributed_results) -> None:
    rank0, rank1 = (r["fsdp2"] for r in distributed_results)
    for r in (rank0, rank1):
        assert (r["strategy"], r["world_size"], r["layer_params"]) == ("fsdp2", 2, 13 * 7 + 7)  # fully_shard-ed units
        for key in ("params", "grads", "optimizer"):
            assert r["measured"][key] == r["expected"][key], key
    # dim-0 chunks 7 -> 4+3, 9 -> 5+4, 3 -> 2+1: params/grads padded to the first chunk on both
    # ranks, optimizer state only over the rank's own rows
    padded = (4 * 13 + 4) + (5 * 7 + 5) + (2 * 9 + 2)
    assert rank0["measured"]["params"] == rank1["measured"]["params"] == padded * 4
    assert rank0["measured"]["optimizer"] == 2 * 4 * padded + 6 * 4
    assert rank1["measured"]["optimizer"] == 2 * 4 * ((3 * 13 + 3) + (4 * 7 + 4) + (1 * 9 + 1)) + 6 * 4


# ---------------------------------------------------------------------------------------------
# the command line


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="memcallbacks")
    _estimate_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_params_markdown_reproduces_seed_000(capsys) -> None:
    code, out, err = _cli(
        ["estimate", "--params", "4e9", "--largest-layer", "1e9", "--precision", "bf16-mixed", "--strategies", "fsdp2,ddp",
         "--world-sizes", "8,16", "--unit", "GB"],
        capsys,
    )
    assert code == 0 and err == ""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| quantity"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["quantity", "fsdp2 x8", "fsdp2 x16", "ddp x8", "ddp x16"]
    steady = next(line for line in lines if "device/steady (GB)" in line)
    backward = next(line for line in lines if "device/backward_peak (GB)" in line)
    assert steady.split("|")[2].strip() == "6.00" and backward.split("|")[2].strip() == "12.00"


def test_cli_hf_config_csv(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _cli(["estimate", "--hf-config", str(tmp_path), "--strategies", "fsdp2,zero3", "--world-sizes", "2", "--unit", "bytes", "--format", "csv"], capsys)
    assert code == 0, err
    import io

    import pandas as pd

    table = pd.read_csv(io.StringIO(out), index_col=0)
    # embed 1000*64 + head 64*1000 + final norm 64 + 2 blocks of (4 attn: 64*64, 2 of 64*32 kv ... )
    block = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + mlp + 2 norms
    total = 2 * 1000 * 64 + 64 + 2 * block
    fsdp = estimate(num_params=total, largest_layer_params=block, root_params=total - 2 * block, strategy="fsdp2", world_size=2)
    assert table.loc["device/params (bytes)", "fsdp2 x2"] == total * 4 / 2  # even dims: no padding
    assert table.loc["device/forward_peak (bytes)", "fsdp2 x2"] == fsdp.device_forward_peak
    assert table.loc["device/backward_peak (bytes)", "fsdp2 x2"] == fsdp.device_backward_peak


def test_cli_model_class_on_meta(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "tiny_models_for_cli.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.layers = nn.ModuleList(nn.Linear(1000, 1000) for _ in range(3))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = _cli(["estimate", "--model", "tiny_models_for_cli:Net", "--strategies", "single", "--unit", "bytes", "--format", "csv"], capsys)
    assert code == 0
    assert "device/params (bytes),12012000" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--hf-config", "/does/not/exist.json"], "--hf-config '/does/not/exist.json': no such file"),
        (["--params", "1e9", "--strategies", "fsdp3"], "--strategies 'fsdp3' is not one of"),
        (["--params", "lots"], "--params 'lots' is not a number"),
        (["--params", "1e9", "--world-sizes", "8,x"], "--world-sizes 'x' is not a whole number"),
        (["--model", "no_such_module_xyz:Net"], "cannot import 'no_such_module_xyz'"),
        (["--params", "1e9", "--optimizer", "lion"], "--optimizer 'lion' is not one of"),
    ],
)
def test_cli_errors_exit_2_with_one_line(argv, needle, capsys) -> None:
    code, out, err = _cli(["estimate", *argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("memcallbacks estimate: error: ")
    assert needle in err


def test_main_cli_dispatches_to_estimate(capsys) -> None:
    cli = pytest.importorskip("memcallbacks.cli")
    code = cli.main(["estimate", "--params", "4e9", "--largest-layer", "1e9", "--precision", "bf16-mixed",
                     "--strategies", "fsdp2", "--world-sizes", "8", "--unit", "GB", "--format", "csv"])
    out = capsys.readouterr().out
    assert code == 0 and "device/backward_peak (GB),12.0" in out
    assert cli.main(["estimate", "--params", "4e9", "--strategies", "fsdp3"]) == 2


def test_estimate_is_a_frozen_keyword_only_dataclass() -> None:
    e = estimate(num_params=1e6)
    assert isinstance(e, MemoryEstimate)
    with pytest.raises(Exception):
        e.device_params = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        MemoryEstimate("single")  # type: ignore[misc]
    assert math.isclose(e.device_steady, 1e6 * 12)
