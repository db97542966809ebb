"""Is a device the user named usable in this process? Checked when a monitor is built, not at its first step."""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["unusable_device", "device_for"]


def device_for(owner: str, device: Any, model: Any, optimizer: Any) -> torch.device:
    """The device a monitor measures: ``device`` (checked here, a ``ValueError`` naming ``owner``
    when it is not a usable torch device), else the model's, else the optimizer's parameters', else CPU."""
    if device is not None:
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{owner}(device={device!r}) is not a torch device ({exc}); pass e.g. 'cpu', 'cuda' or "
                "'cuda:0', or leave it out to use the model's device."
            ) from None
        reason = unusable_device(chosen)
        if reason is not None:
            raise ValueError(f"{owner}(device={device!r}) cannot be measured: {reason}. Pass the device your model "
                             "is on (e.g. device='cpu'), or leave device out to use the model's device.")
        return chosen
    tensors: Iterable[torch.Tensor] = ()
    if model is not None:
        tensors = model.parameters()
    elif optimizer is not None:
        tensors = (p for group in getattr(optimizer, "param_groups", []) for p in group["params"])
    for t in tensors:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def unusable_device(device: torch.device) -> str | None:
    """Why ``device`` cannot be measured here (a sentence), or None when it can. CPU and ``meta`` always can."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None:
        return None  # an accelerator without the usual module: its backend reports what it can
    try:
        available = bool(is_available())
    except Exception as exc:  # a broken driver: say so rather than fail later
        return f"torch.{device.type}.is_available() failed ({type(exc).__name__}: {exc})"
    if not available:
        built = "" if device.type != "cuda" or torch.version.cuda else " (this torch build has no CUDA support)"
        return f"no {device.type} device is available in this process{built}"
    count_fn = getattr(module, "device_count", None)
    if device.index is not None and count_fn is not None:
        count = int(count_fn())
        if device.index >= count:
            return f"this process sees {count} {device.type} device(s), numbered 0 to {count - 1}"
    return None
