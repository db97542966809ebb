"""The errors a user must fix before training; the guard (``_runtime/guard.py``) lets them through."""

from __future__ import annotations

__all__ = ["UsageError", "OutputDirError", "SetupError"]


class UsageError(Exception):
    """Mixin for errors the user must fix before training; the guard lets them through."""


class OutputDirError(UsageError, PermissionError):
    """The output folder cannot be written (or is another live monitor's)."""


class SetupError(UsageError, ValueError):
    """A setup the monitor refuses before training (two monitors writing one folder)."""
