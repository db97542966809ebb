"""When memory runs out: each open growth finding's forecast against its limit, said when it moves.

The growth detectors (``leaks/growth.py``, ``host/growth.py``) call :meth:`Forecast.device` or
:meth:`Forecast.host` when they raise, update or settle a finding, with its rate; the forecast they get
back (:func:`~memcallbacks._base.limits.runs_out`, or None) goes into the finding's message and
``details["runs_out"]``. Nothing here runs while no growth finding is open: a healthy run reads the limits
once, at its start, for its journal's ``start`` record (``_files/journal.py``), and never here. The limits are read at the first forecast of a finding and again when the last read is
:data:`REREAD_S` seconds and :data:`REREAD_STEPS` steps old (the rate changes the forecast in between, not
the read); the reads are finding work in the budget's accounts. docs/findings.md, "When memory runs out".
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from memcallbacks._base.columns import ALLOCATED, PEAK_ALLOCATED, PEAK_RESERVED, RESERVED
from memcallbacks._base.limits import HostLimits, Room, runs_out, runs_out_text

__all__ = ["Forecast", "MOVED_SHARE", "REREAD_S", "REREAD_STEPS", "SNAPSHOT_SHARE", "SNAPSHOT_STEPS_LEFT"]

REREAD_S = 1.0
"""Seconds after which a forecast reads the limits again (with :data:`REREAD_STEPS`): other processes,
the page cache and the cgroup's DataLoader workers move the room while the rate stays."""
REREAD_STEPS = 8
"""...and steps: a fast step does not read them at every update of its finding."""
MOVED_SHARE = 0.1
"""A forecast is said again when its step moved by this share of the steps it leaves (and by
:data:`MOVED_MIN_STEPS`), or its limit changed: a rate that settles, accelerates or slows."""
MOVED_MIN_STEPS = 3
SNAPSHOT_STEPS_LEFT = 20
SNAPSHOT_SHARE = 0.15
"""With ``auto_snapshot=True``, a snapshot is taken when a forecast leaves ``SNAPSHOT_STEPS_LEFT`` steps or fewer,
or this share of the steps it forecast from its read (a forecast's own error: a cgroup run forecast at step 9 to run
out at 197 was killed at 182, before a capture begun at 177 was written), plus the steps since the last read, so that
a thinned watch does not read past it."""


class Forecast:
    """The run's forecasts, one per open growth finding (its key); the earliest is the logged key's."""

    def __init__(self, engine: Any, schedule: Any, *, owner: str, logger: logging.Logger) -> None:
        self.engine = engine
        self.schedule = schedule
        self.owner = owner
        self.log = logger
        self.snap: Any = None
        """The session's snapshot policy (``auto_snapshot=True``), told to take one before the end."""
        self.open: dict[str, dict[str, Any]] = {}
        """The latest forecast of each open growth finding, by its key."""
        self.steps_out = math.nan
        """The earliest step memory runs out at among the open forecasts (NaN: none): ``runs_out_in_steps``."""
        self._said: dict[str, dict[str, Any]] = {}  # the forecast last said (logged) per key
        self._host: HostLimits | None = None  # found at the first forecast: a healthy run never looks
        self._rooms: dict[str, tuple[int, float, list[Room]]] = {}  # channel -> (step, time, rooms) of the last read
        self._updated: dict[str, int] = {}  # key -> the step of its last update
        self._spaces: list[tuple[int, int]] = []  # (step, address space) at the host reads under RLIMIT_AS: its own rate
        self._near_at = 0  # the last read step near() saw

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["snap"] = None
        state["_rooms"] = {}
        return state

    def reset(self) -> None:
        self.open.clear()
        self._said.clear()
        self._rooms.clear()
        self._updated.clear()
        self._spaces.clear()
        self.steps_out = math.nan

    # ------------------------------------------------------------------ what the detectors call
    def device(self, step: int, rate: float, new: bool) -> dict[str, Any] | None:
        """The device growth finding's forecast (key ``growth``): against the host's limits on a CPU run,
        else against the device's capacity. ``rate`` 0 withdraws it (the growth settled) and returns the forecast it had
        said, if any."""
        return self.host("growth", step, rate, new) if self._on_host() else self._update("growth", step, rate, new, "device")

    def host(self, key: str, step: int, rate: float, new: bool) -> dict[str, Any] | None:
        """A host growth finding's forecast (``host_growth``, ``host_growth:native``): against the host's limits."""
        return self._update(key, step, rate, new, "host")

    def near(self, step: int) -> None:
        """A read step while a forecast is open: the snapshot before the end once the earliest forecast leaves
        :data:`SNAPSHOT_STEPS_LEFT` steps or fewer (plus the steps since the last read), though its finding did not
        update (a steady rate updates it seldom: a cgroup run was killed with none taken)."""
        gap, self._near_at = step - self._near_at, step
        if self.snap is not None:
            self._snapshot(min(self.open.values(), key=lambda f: f["step"]), step, gap)

    def _snapshot(self, forecast: dict[str, Any], step: int, gap: int) -> None:
        """The snapshot before the end, once ``forecast`` leaves few enough steps (:data:`SNAPSHOT_SHARE`)."""
        left = forecast["step"] - step
        if left <= max(SNAPSHOT_STEPS_LEFT, SNAPSHOT_SHARE * (forecast["step"] - forecast["at_step"])) + gap:
            self.snap.fire("runs_out", step, f"memory runs out in about {max(0, left)} steps ({forecast['limit_source']} limit)")

    # ------------------------------------------------------------------ the forecast
    def _on_host(self) -> bool:
        backend = self.engine.backend
        return backend is None or backend.kind == "cpu"

    def _update(self, key: str, step: int, rate: float, new: bool, channel: str) -> dict[str, Any] | None:
        if not rate > 0:
            return self._withdraw(key)
        t0 = time.perf_counter()
        read_step, rooms = self._read(channel, step)
        schedule = self.schedule
        forecast = runs_out(read_step, rate, rooms, transient=self._transient(channel), rates=self._space_rate(),
                            step_s=schedule.step_time_median_s if schedule is not None else None)
        gap = step - self._updated.get(key, step)
        self._updated[key] = step
        if forecast is None:
            self.open.pop(key, None)
        else:
            self.open[key] = forecast
            self._say(key, forecast, new)
            if self.snap is not None:
                self._snapshot(forecast, step, gap)
        self._earliest()
        if schedule is not None:
            schedule.book_finding(time.perf_counter() - t0)
        return forecast

    def _read(self, channel: str, step: int) -> tuple[int, list[Room]]:
        """The rooms of ``channel`` (``"host"``, ``"device"``) and the step they were read at: read again
        when the last read is old enough, else the last read's (the forecast counts from its step)."""
        last = self._rooms.get(channel)
        now = time.monotonic()
        if last is not None and (step - last[0] < REREAD_STEPS or now - last[1] < REREAD_S):
            return last[0], last[2]
        if channel == "host":
            if self._host is None:
                self._host = HostLimits()
            rooms = self._host.rooms()
            space = next((r.used_bytes for r in rooms if r.source == "rlimit_as"), None)
            if space is not None:
                del self._spaces[1:]  # the first read and the latest: the rate over the whole span
                self._spaces.append((step, space))
        else:
            rooms = self._device_rooms()
        self._rooms[channel] = (step, now, rooms)
        return step, rooms

    def _space_rate(self) -> dict[str, float] | None:
        """The address space's own rate a step over the reads since the first forecast (:data:`REREAD_STEPS` or more
        apart), for RLIMIT_AS: with glibc's adaptive threshold freed blocks stay mapped and the address space grew
        ~12 MiB a step where the resident memory grew 2 (a user check's leak: forecasts of step 180 for a run that
        ended at step 55). None before two reads."""
        spaces = self._spaces
        if len(spaces) < 2 or spaces[-1][0] - spaces[0][0] < REREAD_STEPS:
            return None
        return {"rlimit_as": (spaces[-1][1] - spaces[0][1]) / (spaces[-1][0] - spaces[0][0])}

    def _device_rooms(self) -> list[Room]:
        """The device's room: its capacity (times a per-process fraction), or, when less, what the allocator holds
        plus what the driver has free (other processes and the runtime's context hold the rest), less allocated."""
        engine = self.engine
        backend, capacity = engine.backend, engine.capacity
        if backend is None or not capacity:
            return []
        allocated, reserved = backend.current()
        free = backend.free()
        where = str(backend.device)
        if free is not None and reserved + free < capacity:
            capacity, where = reserved + free, f"{where}: what its allocator holds and the driver has free"
        return [Room("device", int(capacity), int(allocated), where=where)]

    def _transient(self, channel: str) -> int:
        """What a step holds above its start at its peak, from the last sampled rows (0 until one): on the
        host the resident set's peak over its start (a CPU run's rows), on a device the allocated peak's."""
        rows = self.engine.rows[-4:]
        if channel == "host" and not self._on_host():
            return 0  # a device run's rows say nothing of the host's peaks
        start, peak = (RESERVED, PEAK_RESERVED) if channel == "host" else (ALLOCATED, PEAK_ALLOCATED)
        over = [float(r[peak]) - float(r[start]) for r in rows]
        over = [x for x in over if x == x]  # NaN: not read on that row
        return int(max(0.0, *over)) if over else 0

    def _earliest(self) -> None:
        steps = [f["step"] for f in self.open.values()]
        self.steps_out = float(min(steps)) if steps else math.nan

    # ------------------------------------------------------------------ what is said
    def _say(self, key: str, forecast: dict[str, Any], new: bool) -> None:
        """A new (or re-opened) finding's message carries its forecast: its warning says it. Later, a forecast
        that moved, or the first one of a finding raised without one, is said in a line of its own. Rank zero
        only, as the findings."""
        said = self._said.get(key)
        if not new and said is not None and not self._moved(said, forecast):
            return
        self._said[key] = forecast
        if new or self.engine.rank != 0:
            return
        moved = f" (it said step {said['step']:,} at step {said['at_step']:,})" if said is not None else ""
        self.log.warning("%s: the %s finding's forecast%s: %s", self.owner, key, moved, runs_out_text(forecast))

    @staticmethod
    def _moved(said: dict[str, Any], now: dict[str, Any]) -> bool:
        if said["limit_source"] != now["limit_source"]:
            return True
        return abs(now["step"] - said["step"]) >= max(MOVED_MIN_STEPS, MOVED_SHARE * now["steps_left"])

    def _withdraw(self, key: str) -> dict[str, Any] | None:
        """The growth settled: its forecast is withdrawn. Returns the forecast last said of a standing one (None where
        none was): the settled finding's line says the withdrawal (``details["runs_out_withdrawn"]``; one line, one
        cause: ``_base/findings.py``'s ``announce``)."""
        forecast = self.open.pop(key, None)
        said = self._said.pop(key, None)
        self._updated.pop(key, None)
        self._earliest()
        return said if forecast is not None else None
