"""How many cuBLAS workspaces a CUDA training step holds, and from when: one per matmul thread.

``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``getCurrentCUDABlasHandle()`` reserves a handle from a
``thread_local`` pool window (each thread that calls cuBLAS gets a handle of its own) and
``setWorkspaceForHandle`` keeps one workspace per ``(handle, stream)`` in
``cublas_handle_stream_to_workspace()``, allocated through the caching allocator on first use and
never freed while the thread lives. The forward pass and the optimizer run on the thread that calls
them; ``loss.backward()`` on CUDA tensors runs on the autograd engine's device thread (one per
device, started by the first backward), so from the first backward that runs a matmul a process
holds two workspaces (2 x 32 MiB on Hopper).

Where this is an inference: the source shows one workspace per (handle, stream) and one handle per
thread; that backward's matmuls run on the device thread is the autograd engine's design
(``torch/csrc/autograd/engine.cpp``: CUDA work goes to the device's ready queue, served by its own
thread). Other threads that run matmuls (a DataLoader doing GPU work, a second stream) are not
modelled, nor the separate cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE``) that recent torch
versions keep per (handle, stream) when the workspaces are not unified. A step is taken to hold its
workspace from its thread's first matmul; the predicted step can only see matmuls as ops that
produce a tensor (``mm``, ``addmm``, ``bmm``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MATMUL_OPS", "FORWARD_THREAD", "BACKWARD_THREAD", "first_matmuls", "is_matmul"]

FORWARD_THREAD = "forward thread"
"""The thread that runs forward and the optimizer (and calls ``backward()``)."""
BACKWARD_THREAD = "autograd device thread"
"""The autograd engine's thread for the CUDA device: runs backward's kernels."""

# aten ops that call cuBLAS (at::cuda::blas gemm/gemv/dot, cublasLt for addmm with bias)
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "addr", "_addmm_activation",
    "_scaled_mm", "_int_mm", "matmul", "linear",
})


def is_matmul(op: str) -> bool:
    """``"aten.addmm.default"`` -> True."""
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    return name in MATMUL_OPS


def first_matmuls(records: Iterable[object]) -> dict[str, int]:
    """Thread -> the alloc event index of the first matmul it runs in a tracked step (absent: none).

    ``records`` are :class:`memcallbacks.preflight._tracking.Allocation`: ``phase`` says which thread
    made it (``"backward"``: the autograd device thread; ``"forward"``/``"optimizer"``: the caller's).
    """
    first: dict[str, int] = {}
    for record in records:
        phase, op, born = getattr(record, "phase"), getattr(record, "op"), getattr(record, "born")
        if phase == "before" or not is_matmul(op):
            continue
        thread = BACKWARD_THREAD if phase == "backward" else FORWARD_THREAD
        if thread not in first or born < first[thread]:
            first[thread] = born
    return first
