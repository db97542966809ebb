"""The host's memory limits read from this machine's own files (``memcallbacks._base.limits``), and the
forecast's arithmetic: the tightest room, the step's transient, the words.

The cgroup tests make a memory cgroup as a child of this process's own and run a child process in it;
they are skipped, with the reason, where the machine has no memory controller or does not let the test
make one (cgroup v2 without ``memory`` in the parent's ``cgroup.subtree_control``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from memcallbacks._base.limits import Cgroup, HostLimits, Room, find_cgroup, oom_kills, runs_out, runs_out_text

MIB = 1 << 20


def meminfo_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(text.split("MemAvailable:", 1)[1].split()[0]) * 1024


def proc_cgroup_memory_line() -> tuple[int, str] | None:
    """``(version, path)`` of this process's memory cgroup as /proc/self/cgroup names it."""
    v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        ident, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, path
        if ident == "0" and controllers == "":
            v2 = (2, path)
    return v2


def make_child_cgroup(name: str) -> Path:
    """A memory cgroup below this process's own, or a skip saying why the machine allows none."""
    cgroup = find_cgroup()
    if cgroup is None:
        pytest.skip("no memory cgroup controller on this machine (/proc/self/cgroup names none with memory)")
    child = Path(cgroup.dirs[0]) / f"{name}-{os.getpid()}"
    try:
        child.mkdir(exist_ok=True)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup below {cgroup.dirs[0]}: {exc}")
    limit = child / ("memory.limit_in_bytes" if cgroup.version == 1 else "memory.max")
    if not limit.exists():
        child.rmdir()
        pytest.skip(f"cgroup v2: the memory controller is not enabled for children of {cgroup.dirs[0]} "
                    "(its cgroup.subtree_control lacks memory, which a cgroup holding processes cannot enable)")
    return child


@contextlib.contextmanager
def child_memory_cgroup(name: str) -> Iterator[Path]:
    """:func:`make_child_cgroup`, removed after (the killed child leaves it empty once the kernel has reaped it)."""
    child = make_child_cgroup(name)
    try:
        yield child
    finally:
        for _ in range(100):
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def child_cgroup() -> Iterator[Path]:
    with child_memory_cgroup("memcallbacks-limits") as child:
        yield child


def run_in(cgroup: Path | None, code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, joined to ``cgroup`` before ``exec`` (so every page it touches is charged there)."""

    def join() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=join, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


# ---------------------------------------------------------------------- this machine's files
def test_the_cgroup_found_is_the_one_proc_self_cgroup_names() -> None:
    line = proc_cgroup_memory_line()
    cgroup = find_cgroup()
    if line is None or cgroup is None:
        pytest.skip("no memory cgroup on this machine")
    version, path = line
    assert (cgroup.version, cgroup.path) == (version, path)
    limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    assert all((Path(d) / limit_file).exists() for d in cgroup.dirs), cgroup.dirs
    # the process's own folder first, then each ancestor up to the mount's root
    assert cgroup.dirs[0].endswith(path.rstrip("/") or cgroup.mount) and cgroup.dirs[-1] == cgroup.mount
    assert cgroup.name(cgroup.dirs[0]) == f"cgroup v{version} {path}"


def test_memory_available_and_the_process_are_read_from_proc() -> None:
    rooms = {r.source: r for r in HostLimits().rooms()}
    available = meminfo_available()
    room = rooms["memory_available"]
    assert abs(room.room_bytes - available) < 256 * MIB  # read a moment apart on a shared machine
    page = os.sysconf("SC_PAGE_SIZE")
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * page
    assert abs(room.used_bytes - rss) < 64 * MIB
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        assert "rlimit_as" not in rooms


def test_rlimit_as_is_what_the_address_space_may_still_grow_by() -> None:
    result = run_in(None, """
        import json, os, resource
        from memcallbacks._base.limits import HostLimits
        page = os.sysconf("SC_PAGE_SIZE")
        size = int(open("/proc/self/statm").read().split()[0]) * page
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
        limits = HostLimits()
        tight = limits.tightest()
        print(json.dumps({"limit": size + (256 << 20), "source": tight.source, "limit_bytes": tight.limit_bytes,
                          "room": tight.room_bytes}))
    """)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["source"] == "rlimit_as" and got["limit_bytes"] == got["limit"]
    assert 200 * MIB < got["room"] <= 256 * MIB  # what importing the limits module and reading them mapped


def test_a_cgroup_limit_and_its_working_set(child_cgroup: Path) -> None:
    """A child cgroup with a limit: the room is the limit less usage less the inactive file cache, read
    from the cgroup's own files; it is the tightest limit; the OOM killer's count is 0, then 1."""
    version = 1 if (child_cgroup / "memory.limit_in_bytes").exists() else 2
    limit_name, usage_name, inactive = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                                        if version == 1 else ("memory.max", "memory.current", "inactive_file"))
    result = run_in(child_cgroup, f"""
        import json, os
        from memcallbacks._base.limits import HostLimits
        folder = {str(child_cgroup)!r}
        open(os.path.join(folder, {limit_name!r}), "w").write(str(400 << 20))
        kept = bytearray(64 << 20)  # 64 MiB, written: charged to the cgroup
        limits = HostLimits()
        room = next(r for r in limits.rooms() if r.source == "cgroup")
        usage = int(open(os.path.join(folder, {usage_name!r})).read())
        stat = dict(line.split() for line in open(os.path.join(folder, "memory.stat")))
        print(json.dumps({{"dirs": limits.cgroup.dirs, "limit": room.limit_bytes, "used": room.used_bytes,
                          "where": room.where, "usage": usage, "inactive": int(stat[{inactive!r}]),
                          "tightest": limits.tightest().source}}))
    """)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["dirs"][0] == str(child_cgroup)
    assert got["limit"] == 400 * MIB and got["tightest"] == "cgroup"
    assert got["where"].startswith(f"cgroup v{version} /") and got["where"].endswith(child_cgroup.name)
    # the working set as the files said a moment later (the process holds still in between)
    assert abs(got["used"] - (got["usage"] - got["inactive"])) < 8 * MIB, got
    assert got["used"] >= 64 * MIB
    mount = find_cgroup().mount  # type: ignore[union-attr]
    cgroup = Cgroup(version, "/" + str(child_cgroup.relative_to(mount)), (str(child_cgroup),), mount)
    assert oom_kills(cgroup) == 0
    killed = run_in(child_cgroup, "kept = [bytearray(16 << 20) for _ in range(64)]")  # 1 GiB into 400 MiB
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-500:])
    assert oom_kills(cgroup) == 1


# ---------------------------------------------------------------------- cgroup v2 and namespaces: the layout
def fake_proc(tmp_path: Path, cgroup_line: str, mount_root: str) -> tuple[str, Path]:
    """A /proc/<pid> folder naming a cgroup2 mount at ``tmp_path/mnt`` (a layout this machine does not have)."""
    proc, mount = tmp_path / "proc", tmp_path / "mnt"
    proc.mkdir()
    mount.mkdir()
    (proc / "cgroup").write_text(cgroup_line + "\n")
    (proc / "mountinfo").write_text(
        f"25 30 0:23 / /proc rw,nosuid - proc proc rw\n41 31 0:38 {mount_root} {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    return str(proc), mount


def write_cgroup(folder: Path, limit: str, current: int, inactive_file: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(limit + "\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon {current}\nfile 0\ninactive_file {inactive_file}\nactive_file 0\n")


def test_cgroup_v2_the_tightest_ancestor_counts(tmp_path: Path) -> None:
    proc, mount = fake_proc(tmp_path, "0::/job.slice/step", "/")
    write_cgroup(mount / "job.slice" / "step", "max", 300 * MIB, 0)
    write_cgroup(mount / "job.slice", str(1024 * MIB), 700 * MIB, 100 * MIB)  # the job's limit, the step's sibling included
    cgroup = find_cgroup(proc)
    assert cgroup is not None and cgroup.version == 2 and cgroup.dirs[:2] == (str(mount / "job.slice" / "step"), str(mount / "job.slice"))
    room = next(r for r in HostLimits(proc).rooms() if r.source == "cgroup")
    assert (room.limit_bytes, room.used_bytes, room.room_bytes) == (1024 * MIB, 600 * MIB, 424 * MIB)
    assert room.where == "cgroup v2 /job.slice"
    assert "the memory cgroup's limit (1.0 GiB, cgroup v2 /job.slice)" == room.describe()
    # what the journal's start record keeps, read back as it was (the unfinished-run report's reader)
    (mount / "job.slice" / "step" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    record = json.loads(json.dumps(HostLimits(proc).record()))
    assert Cgroup.from_dict(record["cgroup"]) == cgroup and record["cgroup"]["oom_kills"] == 1 == oom_kills(cgroup)
    assert record["cgroup"]["name"] == "cgroup v2 /job.slice/step"
    kept = {r["source"]: r for r in record["limits"]}
    assert Room.from_dict(kept["cgroup"]) == room and kept["cgroup"]["limit"] == room.describe()
    assert record["limits"][0]["room_bytes"] == min(r["room_bytes"] for r in record["limits"])  # the tightest first
    assert Cgroup.from_dict({"version": 2}) is None and Room.from_dict(None) is None


def test_cgroup_v2_in_a_namespace_is_the_mount_itself(tmp_path: Path) -> None:
    """In a cgroup namespace (a container) /proc/self/cgroup says ``0::/`` and the mount is the container's own cgroup."""
    proc, mount = fake_proc(tmp_path, "0::/", "/")
    write_cgroup(mount, str(2048 * MIB), 512 * MIB, 0)
    cgroup = find_cgroup(proc)
    assert cgroup is not None and cgroup.dirs == (str(mount),)
    room = next(r for r in HostLimits(proc).rooms() if r.source == "cgroup")
    assert room.room_bytes == 1536 * MIB


def test_no_limit_no_cgroup_room(tmp_path: Path) -> None:
    proc, mount = fake_proc(tmp_path, "0::/job", "/")
    write_cgroup(mount / "job", "max", 100 * MIB, 0)
    assert not [r for r in HostLimits(proc).rooms() if r.source == "cgroup"]


# ---------------------------------------------------------------------- the forecast's arithmetic
def test_the_tightest_room_less_the_transient_decides() -> None:
    rooms = [Room("memory_available", 20 << 30, 1 << 30), Room("cgroup", 1024 * MIB, 600 * MIB, "cgroup v1 /job"),
             Room("rlimit_as", 8 << 30, 2 << 30)]
    forecast = runs_out(100, 2 * MIB, rooms, transient=24 * MIB, step_s=0.5)
    assert forecast is not None
    # 424 MiB of room, 24 MiB of it the step's own peak: 400 MiB at 2 MiB/step
    assert (forecast["step"], forecast["steps_left"], forecast["seconds"]) == (300, 200, 100.0)
    assert forecast["limit_source"] == "cgroup" and forecast["limit_bytes"] == 1024 * MIB and forecast["room_bytes"] == 424 * MIB
    assert forecast["rooms"] == {"memory_available": 19 << 30, "cgroup": 424 * MIB, "rlimit_as": 6 << 30}
    assert runs_out_text(forecast) == (
        "Memory runs out at about step 300, in about 1.7 min, at this rate (2.0 MiB/step): 424.0 MiB was left under "
        "the memory cgroup's limit (1.0 GiB, cgroup v1 /job) at step 100.")
    assert runs_out_text(forecast, seconds=False).startswith("Memory runs out at about step 300, at this rate")  # read after the run
    assert json.loads(json.dumps(forecast)) == forecast  # finding details are JSON


def test_no_growth_or_no_limit_no_forecast() -> None:
    rooms = [Room("cgroup", 1024 * MIB, 600 * MIB)]
    assert runs_out(10, 0.0, rooms) is None and runs_out(10, -5.0, rooms) is None
    assert runs_out(10, 1e6, []) is None
    assert runs_out_text(None) == ""


def test_a_rate_that_accelerates_brings_the_end_closer() -> None:
    rooms = [Room("device", 80 << 30, 40 << 30, "cuda:0")]
    slow, fast = runs_out(50, 64 * MIB, rooms), runs_out(50, 256 * MIB, rooms)
    assert slow is not None and fast is not None
    assert (slow["step"], fast["step"]) == (50 + 640, 50 + 160)
    assert fast["seconds"] is None and "in about" not in runs_out_text(fast)  # no step time measured yet
    assert "the device's capacity (80.0 GiB, cuda:0)" in runs_out_text(fast)


def test_no_room_left_runs_out_now() -> None:
    forecast = runs_out(77, MIB, [Room("rlimit_as", 1 << 30, (1 << 30) + MIB)], transient=MIB)
    assert forecast is not None and (forecast["step"], forecast["steps_left"]) == (77, 0)
    assert runs_out_text(forecast).startswith("Memory runs out now (step 77), at this rate (1.0 MiB/step): 0 B was left")
    assert not math.isnan(forecast["room_bytes"])
