"""Host reads: statm, the Python block count, smaps_rollup, arena bytes — real memory, real processes."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from memcallbacks._base.units import MiB
from memcallbacks.host import HostReader, StatmReader, measure_costs, pymalloc_arena_bytes, python_object_blocks, smaps_rollup

linux = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")


@linux
def test_private_memory_follows_touched_pages():
    statm = StatmReader()
    rss0, private0 = statm.read()
    # an anonymous mapping of its own, not a bytearray: malloc may place one in heap pages an earlier
    # test left resident (a raised mmap threshold, as cpu_mmap_threshold sets), which writing adds nothing to
    buf = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed: resident only once written
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    rss1, private1 = statm.read()
    assert private1 - private0 >= 60 * MiB and rss1 - rss0 >= 60 * MiB
    buf.close()
    statm.close()


def test_python_blocks_count_python_objects():
    before = python_object_blocks()
    kept = [{"i": i} for i in range(20_000)]
    assert python_object_blocks() - before >= 20_000
    del kept


@linux
def test_reader_reads_every_call_and_blocks_on_a_cost_chosen_stride():
    reader = HostReader(blocks_budget_us=0.001, max_blocks_every=8)  # a budget no block read meets: the cap
    readings = [reader.read(step) for step in range(40)]
    assert all(r.rss_bytes > r.private_bytes > 0 for r in readings)
    with_blocks = [r.step for r in readings if r.python_blocks is not None]
    assert with_blocks[0] == 0 and reader.blocks_every == 8
    assert all(b - a <= 8 for a, b in zip(with_blocks, with_blocks[1:]))
    assert reader.seconds > 0
    generous = HostReader(blocks_budget_us=1e9)
    assert all(generous.read(s).python_blocks is not None for s in range(5))
    reader.close()


@linux
def test_smaps_rollup_uss_and_a_child_process():
    me = smaps_rollup()
    assert me is not None and 0 < me["uss"] <= me["rss"] and me["pss"] > 0
    assert smaps_rollup(2**22 + 12345) is None  # no such process


def test_arena_bytes_and_costs_are_measured():
    arenas = pymalloc_arena_bytes()
    if arenas is not None:  # CPython prints its arena total
        assert arenas >= python_object_blocks() * 8 // 2
    costs = measure_costs(repeat=20)
    assert costs["statm (kept-open fd)"] > 0 and costs["sys.getallocatedblocks"] > 0
    assert costs["smaps_rollup (USS/PSS)"] > costs["statm (kept-open fd)"]
    print({k: round(v, 1) for k, v in costs.items()}, file=sys.stderr)


def test_bad_parameters_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"blocks_budget_us=0.*positive"):
        HostReader(blocks_budget_us=0)
    with pytest.raises(ValueError, match=r"max_blocks_every=0.*>= 1"):
        HostReader(max_blocks_every=0)
    with pytest.raises(ValueError, match=r"repeat=0"):
        measure_costs(repeat=0)
