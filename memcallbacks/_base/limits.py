"""Memory limits and the room under each (cgroup, MemAvailable, RLIMIT_AS, device); when it runs out.

A process runs out of memory at the first limit it reaches. On the host that is the smallest room of:

- ``memory_available``: ``MemAvailable`` of ``/proc/meminfo``, what the kernel says can still be
  allocated without swapping (free memory plus the page cache it can reclaim); the limit is that plus
  the process's resident set;
- ``cgroup``: the memory cgroup's limit (v1 ``memory.limit_in_bytes``, v2 ``memory.max``), at the
  process's cgroup and every ancestor up to the mount's root, less what the cgroup uses: its usage
  (v1 ``memory.usage_in_bytes``, v2 ``memory.current``) less its inactive file cache
  (``total_inactive_file`` / ``inactive_file`` of ``memory.stat``), the *working set* the kernel's OOM
  killer and the kubelet judge by. Usage counts the whole cgroup: DataLoader workers and any other
  process in it, its page cache (the kernel reclaims the inactive part before it kills: not used; the
  active part it reclaims only under pressure: counted), and kernel memory (v2);
- ``rlimit_as``: ``RLIMIT_AS`` less the address space mapped now (``VmSize``): an allocation past it
  fails (``MemoryError``, "can't allocate memory") instead of a kill.

A device (CUDA, other torch accelerators) has one limit, its capacity (``device``), which the
runtime reads through the device seam and hands in as a :class:`Room`.

Reads are files under ``/proc`` and the cgroup mount (tens of microseconds each): made when a
forecast asks, and once at a run's start for its journal (:meth:`HostLimits.record`: the rooms then and
the cgroup's OOM-kill count, which the unfinished-run report reads back with :meth:`Cgroup.from_dict`,
:func:`oom_kills` and :meth:`Room.from_dict`), never per step. :func:`runs_out` turns the tightest room
and a growth rate into the forecast a growth finding carries (``details["runs_out"]``, docs/findings.md);
:func:`runs_out_text` says it in words.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from typing import Any

from memcallbacks._base.units import format_bytes, format_duration

__all__ = ["Cgroup", "HostLimits", "Room", "SOURCES", "cgroup_room", "find_cgroup", "oom_kills", "runs_out", "runs_out_text"]

SOURCES = ("device", "cgroup", "memory_available", "rlimit_as")
"""Where a limit comes from: ``details["runs_out"]["limit_source"]``."""

_UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as the largest page-aligned 64-bit value (9223372036854771712); anything this
large is no limit."""


@dataclass(frozen=True)
class Room:
    """One limit and what counts against it now: the process can grow by :attr:`room_bytes` before it."""

    source: str
    """One of :data:`SOURCES`."""
    limit_bytes: int
    used_bytes: int
    where: str = ""
    """The cgroup's path, or the device's name."""

    @property
    def room_bytes(self) -> int:
        return self.limit_bytes - self.used_bytes

    def describe(self) -> str:
        """The limit in words: ``the memory cgroup's limit (1.1 GiB)``."""
        size = format_bytes(self.limit_bytes)
        if self.source == "cgroup":
            return f"the memory cgroup's limit ({size}{', ' + self.where if self.where else ''})"
        if self.source == "rlimit_as":
            return f"the address-space limit RLIMIT_AS ({size})"
        if self.source == "memory_available":
            return f"the host's memory (MemAvailable, {format_bytes(self.room_bytes)}, beyond the process's {format_bytes(self.used_bytes)})"
        return f"the device's capacity ({size}{', ' + self.where if self.where else ''})"

    def to_dict(self) -> dict[str, Any]:
        """As the journal's ``start`` record keeps it: the fields, the room, and :meth:`describe`'s words (``limit``)."""
        return {"source": self.source, "limit_bytes": int(self.limit_bytes), "used_bytes": int(self.used_bytes),
                "room_bytes": int(self.room_bytes), "where": self.where, "limit": self.describe()}

    @classmethod
    def from_dict(cls, record: Any) -> Room | None:
        """A room :meth:`to_dict` wrote (None: not one)."""
        try:
            return cls(str(record["source"]), int(record["limit_bytes"]), int(record["used_bytes"]), str(record.get("where") or ""))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


# ---------------------------------------------------------------------- the memory cgroup
@dataclass(frozen=True)
class Cgroup:
    """The process's memory cgroup: its version, its path as ``/proc/self/cgroup`` names it, and the
    folders to read, the process's own first, then each ancestor up to the mount's root."""

    version: int
    path: str
    dirs: tuple[str, ...]
    mount: str = "/sys/fs/cgroup"
    """Where the hierarchy is mounted: a folder's cgroup is its path below."""

    def name(self, folder: str) -> str:
        """``folder``'s cgroup as the kernel names it (``/user.slice/job``), with the version."""
        return f"cgroup v{self.version} {folder[len(self.mount):] or '/'}" if folder.startswith(self.mount) else folder

    def to_dict(self) -> dict[str, Any]:
        """As the journal's ``start`` record keeps it (read back by :meth:`from_dict`, on the same host)."""
        return {"version": self.version, "path": self.path, "dirs": list(self.dirs), "mount": self.mount, "name": self.name(self.dirs[0])}

    @classmethod
    def from_dict(cls, record: Any) -> Cgroup | None:
        """A cgroup :meth:`to_dict` wrote (None: not one)."""
        try:
            dirs = tuple(str(d) for d in record["dirs"])
            return cls(int(record["version"]), str(record["path"]), dirs, str(record["mount"])) if dirs else None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode()
    except OSError:
        return None
    finally:
        os.close(fd)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """``(fstype, root, mountpoint, super options)`` of every cgroup and cgroup2 mount in ``mountinfo``."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((tail[0], fields[3], fields[4].replace("\\040", " "), tail[2]))
    return out


def _folders(path: str, root: str, mountpoint: str) -> tuple[str, ...]:
    """The cgroup folders from ``path``'s own up to the mount's root. In a cgroup namespace, or a mount of a
    subtree, ``path`` need not start with the mount's ``root``: then the mount's own folder is the cgroup."""
    rel = path[len(root):] if root != "/" and path.startswith(root) else (path if root == "/" else "/")
    parts = [p for p in rel.split("/") if p]
    dirs = [os.path.join(mountpoint, *parts[:n]) for n in range(len(parts), -1, -1)]
    return tuple(d for d in dirs if os.path.isdir(d)) or (mountpoint,)


def find_cgroup(proc: str = "/proc/self") -> Cgroup | None:
    """The memory cgroup of the process ``proc`` names: v1 where a v1 hierarchy has the memory controller,
    else v2 where ``memory.max`` is there to read; None off Linux or without a memory controller."""
    table, mountinfo = _read(f"{proc}/cgroup"), _read(f"{proc}/mountinfo")
    if table is None or mountinfo is None:
        return None
    v1 = v2 = None
    for line in table.splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if ident == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    mounts = _mounts(mountinfo)
    if v1 is not None:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and "memory" in options.split(","):
                return Cgroup(1, v1, _folders(v1, root, point), point)
    if v2 is not None:
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                dirs = tuple(d for d in _folders(v2, root, point) if os.path.exists(os.path.join(d, "memory.max")))
                if dirs:
                    return Cgroup(2, v2, dirs, point)
    return None


def _stat_value(text: str | None, name: str) -> int:
    if text:
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


def cgroup_room(cgroup: Cgroup) -> Room | None:
    """The tightest limit among the cgroup and its ancestors, and the working set it holds (usage less
    the inactive file cache); None without a limit, or where the cgroup is gone."""
    limit_file, usage_file, inactive = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                                        if cgroup.version == 1 else ("memory.max", "memory.current", "inactive_file"))
    best: Room | None = None
    for folder in cgroup.dirs:
        text = _read(os.path.join(folder, limit_file))
        if text is None or not text.strip() or text.strip() == "max":
            continue
        limit = int(text)
        if limit >= _UNLIMITED:
            continue
        usage = _read(os.path.join(folder, usage_file))
        if usage is None:
            continue
        cache = _stat_value(_read(os.path.join(folder, "memory.stat")), inactive)
        room = Room("cgroup", limit, max(0, int(usage) - cache), where=cgroup.name(folder))
        if best is None or room.room_bytes < best.room_bytes:
            best = room
    return best


def oom_kills(cgroup: Cgroup) -> int | None:
    """How many processes the kernel's OOM killer ended in the process's cgroup (v1 ``memory.oom_control``,
    v2 ``memory.events``: ``oom_kill``); None where the kernel does not say."""
    text = _read(os.path.join(cgroup.dirs[0], "memory.oom_control" if cgroup.version == 1 else "memory.events"))
    if text is None or "oom_kill " not in text:
        return None
    return _stat_value(text, "oom_kill")


# ---------------------------------------------------------------------- the host's limits
class HostLimits:
    """The host limits of this process, read when asked: :meth:`rooms` gives each, :meth:`tightest` the one
    with the least room. The cgroup is found once, at construction (``/proc/self/cgroup`` and
    ``mountinfo``); the values are read at every call (~0.1 ms for all of them)."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self.proc = proc
        self.cgroup = find_cgroup(proc)
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rooms(self) -> list[Room]:
        """Every host limit that applies now (none where ``/proc`` cannot be read)."""
        out: list[Room] = []
        statm = _read(f"{self.proc}/statm")
        size = rss = 0
        if statm:
            fields = statm.split()
            size, rss = int(fields[0]) * self.page, int(fields[1]) * self.page
        meminfo = _read("/proc/meminfo")
        if meminfo and "MemAvailable:" in meminfo:
            available = int(meminfo.split("MemAvailable:", 1)[1].split()[0]) * 1024
            out.append(Room("memory_available", available + rss, rss))
        if self.cgroup is not None:
            room = cgroup_room(self.cgroup)
            if room is not None:
                out.append(room)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and size:
            out.append(Room("rlimit_as", int(soft), size))
        return out

    def tightest(self) -> Room | None:
        rooms = self.rooms()
        return min(rooms, key=lambda r: r.room_bytes) if rooms else None

    def record(self) -> dict[str, Any]:
        """What the journal's ``start`` record keeps of them (docs/journal.md): ``limits``, every room now, the
        tightest first; ``rss_bytes``, the resident set then (what the process grew by since is read against
        the rooms); ``cgroup``, the memory cgroup (:meth:`Cgroup.to_dict`) with its OOM-kill count then."""
        rooms = sorted(self.rooms(), key=lambda r: r.room_bytes)
        statm = _read(f"{self.proc}/statm")
        cgroup = self.cgroup
        return {"limits": [r.to_dict() for r in rooms],
                "rss_bytes": int(statm.split()[1]) * self.page if statm else None,
                "cgroup": None if cgroup is None else {**cgroup.to_dict(), "oom_kills": oom_kills(cgroup)}}


# ---------------------------------------------------------------------- the forecast
def runs_out(step: int, rate: float, rooms: list[Room], *, transient: int = 0, step_s: float | None = None,
             rates: dict[str, float] | None = None) -> dict[str, Any] | None:
    """When memory runs out at ``rate`` bytes a step from ``step``, against the limit of ``rooms`` it reaches first;
    None without growth or a limit.

    The first step whose peak does not fit: the room left at ``step`` less ``transient`` (what a step
    holds above its start at its peak), divided by the rate. ``rates``: a faster rate measured against one limit
    (``{"rlimit_as": ...}``: the address space, which grows faster than the resident memory where freed blocks
    stay mapped). ``step_s``: a step's median time, for ``seconds``. The dict is what a growth finding carries as
    ``details["runs_out"]``."""
    if not rate > 0 or not rooms:
        return None

    def left_at(room: Room) -> tuple[int, float]:
        its = max(rate, (rates or {}).get(room.source, 0.0))
        return max(0, math.floor((room.room_bytes - max(0, int(transient))) / its)), its

    tight = min(rooms, key=lambda r: (left_at(r)[0], r.room_bytes))
    left, its = left_at(tight)
    return {
        "step": int(step + left),
        "steps_left": int(left),
        "seconds": round(left * step_s, 1) if step_s and step_s > 0 and math.isfinite(step_s) else None,
        "limit_bytes": int(tight.limit_bytes),
        "limit_source": tight.source,
        "limit": tight.describe(),
        "used_bytes": int(tight.used_bytes),
        "room_bytes": int(tight.room_bytes),
        "transient_bytes": max(0, int(transient)),
        "rate_bytes_per_step": int(its),
        "rate_of": "address space" if its > rate else "",  # the limit's own rate, faster than the growth's
        "at_step": int(step),
        "step_time_s": step_s if step_s and math.isfinite(step_s) else None,
        "rooms": {r.source: int(r.room_bytes) for r in rooms},
    }


def runs_out_text(forecast: dict[str, Any] | None, end: str = "", *, seconds: bool = True) -> str:
    """The forecast in one sentence, the answer first, then ``end`` ("" without one): ``Memory runs out at about
    step 187, in about 25 s, at this rate (2.0 MiB/step): 350.2 MiB was left under the memory cgroup's limit
    (1.1 GiB, cgroup v1 /job) at step 12.`` ``seconds=False`` leaves the time out (a run read after its end)."""
    if not forecast:
        return ""
    if forecast["steps_left"] <= 0:
        when = f"Memory runs out now (step {forecast['step']:,})"
    else:
        left = forecast.get("seconds") if seconds else None
        when = f"Memory runs out at about step {forecast['step']:,}" + (f", in about {format_duration(left)}" if left else "")
    of = f" of {forecast['rate_of']}" if forecast.get("rate_of") else ""
    return (f"{when}, at this rate ({format_bytes(forecast['rate_bytes_per_step'])}/step{of}): "
            f"{format_bytes(max(0, forecast['room_bytes']))} was left under {forecast['limit']} at step {forecast['at_step']:,}.{end}")
