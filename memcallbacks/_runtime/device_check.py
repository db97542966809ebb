"""Is a device the user named usable in this process? Checked when a monitor is built, not at its first step."""

from __future__ import annotations

import torch

__all__ = ["unusable_device"]


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
