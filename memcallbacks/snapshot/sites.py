"""Allocation sites: which line of user code an allocation belongs to, and allocations grouped by site.

The site is the innermost Python frame outside torch and memcallbacks; the frames above it are its callers.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from memcallbacks.snapshot.files import OP_FILENAME

__all__ = ["NO_STACK", "BEFORE_TRACE", "Allocation", "SiteTotal", "frame_label", "group_by_site"]

# The package roots that make a frame internal, by the real directories, not by any folder's name: a
# virtual environment inside a folder named ``torch`` (``/work/torch/venv/.../site-packages/x.py``) or
# a user's ``memcallbacks_demo/`` is user code.
# Found without importing torch: reading a snapshot offline (``memcallbacks summary``) needs no torch.
_TORCH_SPEC = importlib.util.find_spec("torch")
_TORCH_DIR = (os.path.dirname(os.path.abspath(_TORCH_SPEC.origin)) if _TORCH_SPEC and _TORCH_SPEC.origin else "/nonexistent/torch") + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # memcallbacks/, every wing
# Frames recorded by another process or machine (a snapshot loaded here): torch or memcallbacks as an
# installed package (the folder right under site-packages/dist-packages), or a path the profiler
# trimmed to the package ("torch/nn/modules/linear.py"): relative, starting at the package folder.
_INSTALLED_RE = re.compile(r"[\\/](?:site|dist)-packages[\\/](?:torch|memcallbacks)[\\/]")
_TRIMMED_RE = re.compile(r"^(?:torch|memcallbacks)[\\/]")


def _is_python_frame(f: dict[str, Any]) -> bool:
    name = str(f.get("filename", ""))
    return name.endswith(".py") or name in ("<stdin>", "<string>") or name.startswith("<ipython")


def _is_internal(f: dict[str, Any]) -> bool:
    name = str(f.get("filename", ""))
    if name.startswith(_TORCH_DIR) or name.startswith(_PKG_DIR) or _INSTALLED_RE.search(name) is not None:
        return True
    return not os.path.isabs(name) and _TRIMMED_RE.match(name) is not None


def frame_label(f: dict[str, Any]) -> str:
    """``"train.py:42 in forward"``."""
    return f"{os.path.basename(str(f.get('filename', '?')))}:{f.get('line', 0)} in {f.get('name', '?')}"


def _site_index(frames: Sequence[dict[str, Any]]) -> int | None:
    """The frame to name an allocation by: the innermost Python frame outside torch (and memcallbacks)."""
    first_python = None
    for i, f in enumerate(frames):
        if _is_python_frame(f):
            if not _is_internal(f):
                return i
            if first_python is None:
                first_python = i
    if first_python is not None:
        return first_python
    return 0 if frames else None


NO_STACK = "<no stack recorded>"
BEFORE_TRACE = "<allocated before the trace, no stack>"


@dataclass(frozen=True)
class Allocation:
    """One allocation seen in a snapshot."""

    addr: int
    size: int
    frames: tuple[dict[str, Any], ...] = field(repr=False)
    index: int | None
    """Trace entry of the ``alloc``; ``None`` when it happened before the trace (older or dropped)."""
    freed_only: bool = False
    """Only its free was traced: the frames are those of the free."""
    holder: dict[str, Any] | None = field(default=None, repr=False)
    """Census data (``category``, ``holder``, ``shape``, ``path``) when the snapshot carries it."""
    pending_free: bool = False
    """Freed by Python but not yet reusable (``free_requested`` without ``free_completed``: in use on a stream)."""

    @property
    def site(self) -> str:
        i = _site_index(self.frames)
        if i is None:
            return BEFORE_TRACE if self.index is None and not self.freed_only else NO_STACK
        f = self.frames[i]
        if f.get("filename") == OP_FILENAME:
            return f"{f.get('name', '?')} (no Python stack)"
        return frame_label(f)

    @property
    def site_file(self) -> str:
        i = _site_index(self.frames)
        return "" if i is None else f"{self.frames[i].get('filename', '')}:{self.frames[i].get('line', 0)}"

    @property
    def callers(self) -> tuple[str, ...]:
        """Up to three Python frames outside torch above the site."""
        i = _site_index(self.frames)
        if i is None:
            return ()
        out = [frame_label(f) for f in self.frames[i + 1:] if _is_python_frame(f) and not _is_internal(f)]
        return tuple(out[:3])

    @property
    def op(self) -> str:
        for f in self.frames:
            if f.get("filename") == OP_FILENAME:
                return str(f.get("name", ""))
        return ""

    @property
    def what(self) -> str:
        """Op, census category/holder/shape: whatever the snapshot says about the tensor."""
        parts = []
        if self.op:
            parts.append(self.op)
        if self.holder:
            h = self.holder
            parts.append(" ".join(str(x) for x in (h.get("shape"), h.get("category")) if x))
            if h.get("holder"):
                parts.append(f"held by {h['holder']}")
        if self.freed_only:
            parts.append("(stack of its free)")
        if self.pending_free:
            parts.append("freed, waiting for its stream")
        return ", ".join(p for p in parts if p)


@dataclass
class SiteTotal:
    """Allocations grouped by site."""

    site: str
    bytes: int
    count: int
    callers: tuple[str, ...]
    site_file: str
    what: str


def group_by_site(allocs: Iterable[Allocation], top: int) -> list[SiteTotal]:
    """The ``top`` sites by bytes; each row names the site by its largest allocation."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for a in allocs:
        key = (a.site_file or a.site, a.op)  # one line of user code can allocate very different things
        g = groups.get(key)
        if g is None:
            g = groups[key] = [a, 0, 0]
        g[1] += a.size
        g[2] += 1
        if a.size > g[0].size:
            g[0] = a
    rows = [SiteTotal(a.site, n, c, a.callers, a.site_file, a.what) for a, n, c in groups.values()]
    rows.sort(key=lambda r: -r.bytes)
    return rows[:top]
