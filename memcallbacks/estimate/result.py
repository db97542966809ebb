"""The result of ``estimate()``: model-state bytes per rank, by component and phase."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memcallbacks.estimate.tables import unit_scale

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["MemoryEstimate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Model-state bytes on one rank: persistent parts, transient working sets and per-phase peaks.

    "device" is the accelerator the model runs on, "host" is CPU memory. All byte fields are
    ``int``; phases are measured as ``torch.cuda.memory_allocated()`` would see them (model states
    only: activations, the CUDA context and allocator caching are not included).
    """

    strategy: str
    """Canonical strategy: one of :data:`STRATEGIES`."""
    sharding: str | None
    """FSDP sharding (``"full"``, ``"grad_op"``, ``"hybrid"``); ``None`` for other strategies."""
    world_size: int
    """Number of data-parallel ranks."""
    shard_size: int
    """Ranks a sharded tensor is split over (world size, or the hybrid shard group size; 1 if unsharded)."""
    rank: int
    """The rank this estimate describes (FSDP2 shards unevenly: rank 0 holds the largest chunk)."""
    ranks_per_node: int
    """Ranks sharing one host, used for :attr:`host_peak_per_node`."""
    precision: str
    """Canonical precision: one of :data:`PRECISIONS`."""
    optimizer: str
    """Optimizer label, e.g. ``"adamw+amsgrad"`` or ``"8.0 B/param"``."""
    num_params: int
    """Parameter elements in the model (tied parameters counted once)."""
    trainable_params: int
    """Parameter elements that receive a gradient."""
    layer_params: int
    """Elements of the largest unit FSDP wraps / ZeRO-3 gathers."""
    root_params: int
    """Elements left outside every unit (FSDP's root unit: gathered for the whole forward and backward)."""
    offload_optimizer: bool
    """Optimizer state (and DeepSpeed's fp32 master and gradient partitions) in host memory."""
    offload_param: bool
    """Sharded parameters in host memory (FSDP: params, grads and optimizer state)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""
    device_params: int
    """Parameters held on the device between steps (sharded where the strategy shards)."""
    device_grads: int
    """Gradients held on the device after backward, before ``zero_grad`` (sharded where sharded)."""
    device_optimizer: int
    """Optimizer state on the device, including DeepSpeed's fp32 master partition."""
    device_comm_buffers: int
    """Persistent communication buffers: DDP's gradient buckets, DeepSpeed's reduce bucket."""
    device_forward_working: int
    """Transient bytes at the forward peak: gathered layers (FSDP/ZeRO-3), autocast weight casts."""
    device_backward_working: int
    """Transient bytes at the backward peak: gathered layer params and unsharded layer grads."""
    device_optimizer_working: int
    """Transient bytes during ``optimizer.step()``: foreach temporaries, DeepSpeed's fp32 grad partition."""
    device_steady: int
    """At the start of a step (after ``zero_grad``): what never goes away."""
    device_forward_peak: int
    """Model-state peak during forward."""
    device_backward_peak: int
    """Model-state peak during backward."""
    device_optimizer_peak: int
    """Model-state peak during ``optimizer.step()``."""
    host_params: int
    """Parameters offloaded to host memory."""
    host_grads: int
    """Gradients in host memory (offloaded optimizer: DeepSpeed's fp32/low-precision partitions)."""
    host_optimizer: int
    """Optimizer state in host memory (offload; torch's Adam keeps its ``step`` scalars on the CPU)."""
    host_init: int
    """Host bytes while the model is being built (a full CPU copy unless built partitioned/on meta)."""
    host_steady: int
    """Host bytes that persist between steps."""
    host_peak: int
    """Largest host footprint: init, steady or during the (offloaded) optimizer step."""
    notes: tuple[str, ...] = ()
    """Assumptions that applied to this estimate, in words."""

    @property
    def device_peak(self) -> int:
        """The largest of the four device phases."""
        return max(self.device_steady, self.device_forward_peak, self.device_backward_peak, self.device_optimizer_peak)

    @property
    def host_peak_per_node(self) -> int:
        """:attr:`host_peak` times :attr:`ranks_per_node` (DeepSpeed's estimators report per node)."""
        return self.host_peak * self.ranks_per_node

    @property
    def label(self) -> str:
        """A short column name: ``"fsdp2 x8"``, ``"zero3+offload_param x16"``, ``"fsdp/hybrid(8) x64"``."""
        name = self.strategy
        if self.sharding is not None and self.sharding != "full":
            name += f"/{self.sharding}" + (f"({self.shard_size})" if self.sharding == "hybrid" else "")
        if self.offload_optimizer:
            name += "+offload_opt"
        if self.offload_param:
            name += "+offload_param"
        return f"{name} x{self.world_size}"

    def expected_measurement(self) -> dict[str, int]:
        """What :func:`measure_model_states` should read right after ``optimizer.step()``.

        Same keys as :func:`measure_model_states`. Communication buffers are not included (DDP's
        buckets are not reachable from Python unless ``gradient_as_bucket_view``, where they *are*
        the gradients). Meaningful for torch strategies; DeepSpeed keeps its partitions outside
        ``param.grad`` and ``optimizer.state``.
        """
        out = {
            "device_params": self.device_params,
            "device_grads": self.device_grads,
            "device_optimizer": self.device_optimizer,
            "host_params": self.host_params,
            "host_grads": self.host_grads,
            "host_optimizer": self.host_optimizer,
        }
        for kind in ("params", "grads", "optimizer"):
            out[kind] = out[f"device_{kind}"] + out[f"host_{kind}"]
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def to_frame(self, unit: str = "bytes") -> pd.DataFrame:
        """One row per component or phase, columns ``device`` and ``host`` in ``unit`` (bytes, GB, GiB, MB, MiB)."""
        import pandas as pd

        scale = unit_scale(unit, "MemoryEstimate.to_frame")
        rows = {
            "params": (self.device_params, self.host_params),
            "grads": (self.device_grads, self.host_grads),
            "optimizer": (self.device_optimizer, self.host_optimizer),
            "comm_buffers": (self.device_comm_buffers, 0),
            "forward_working": (self.device_forward_working, 0),
            "backward_working": (self.device_backward_working, 0),
            "optimizer_working": (self.device_optimizer_working, 0),
            "init": (0, self.host_init),
            "steady": (self.device_steady, self.host_steady),
            "forward_peak": (self.device_forward_peak, self.host_steady),
            "backward_peak": (self.device_backward_peak, self.host_steady),
            "optimizer_peak": (self.device_optimizer_peak, self.host_peak),
            "peak": (self.device_peak, self.host_peak),
        }
        frame = pd.DataFrame.from_dict(rows, orient="index", columns=["device", "host"])
        frame.index.name = f"{self.label} ({unit})"
        return frame if scale == 1 else frame / scale
