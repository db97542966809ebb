"""The device seam against the real process: CPU heap/RSS/high-water-mark reads, and CUDA behind the ``cuda`` marker."""

from __future__ import annotations

import mmap
import os
import sys
import threading

import psutil
import pytest
import torch

from helpers import MIB, touch_temporary
from memcallbacks._base.devices import CpuBackend, CudaBackend, host_rss_reader, select_backend, set_mmap_threshold

linux_hwm = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
    reason="resettable RSS high-water mark needs a writable /proc/self/clear_refs",
)


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture
def cpu():
    backend = CpuBackend()
    yield backend
    backend.close()


def test_select_backend_cpu():
    for device in ("cpu", torch.device("cpu"), None):
        backend = select_backend(device)
        try:
            assert isinstance(backend, CpuBackend)
            assert backend.kind == "cpu"
            expected = "rss_high_water_mark" if os.access("/proc/self/clear_refs", os.W_OK) else "sampled"
            assert backend.peak_source == expected
            assert backend.describe() == {
                "kind": "cpu",
                "device": "cpu",
                "peak_source": expected,
                "allocated_source": "glibc mallinfo2" if sys.platform.startswith("linux") else "rss",
            }
        finally:
            backend.close()


def test_baseline_numbers_are_sane(cpu):
    allocated, reserved, peak_allocated, peak_reserved = cpu.baseline()
    now = rss()
    assert allocated > 1 * MIB
    assert abs(reserved - now) < 4 * MIB, (reserved / MIB, now / MIB)
    assert peak_allocated == peak_reserved  # CPU peaks are RSS peaks
    assert peak_reserved >= reserved - 4 * MIB
    assert cpu.counters() == {}
    capacity = cpu.capacity()
    assert capacity == psutil.virtual_memory().total and capacity > reserved


def test_allocated_follows_live_tensors(cpu):
    before = cpu.baseline()[0]
    live = torch.ones(64 * MIB, dtype=torch.uint8)
    during = cpu.baseline()[0]
    del live
    after = cpu.baseline()[0]
    assert abs((during - before) - 64 * MIB) < 2 * MIB, (during - before) / MIB
    assert abs(after - before) < 2 * MIB, (after - before) / MIB


@linux_hwm
def test_interval_peak_sees_a_freed_temporary_and_the_next_interval_does_not(cpu):
    base = cpu.baseline()[1]
    touch_temporary(128)
    peak_a, peak_r = cpu.interval()
    assert peak_a == peak_r
    assert 120 * MIB <= peak_r - base <= 160 * MIB, (peak_r - base) / MIB
    assert rss() - base < 16 * MIB  # the temporary is gone from the resident set
    quiet = cpu.interval()[1]
    assert quiet - base < 16 * MIB, (quiet - base) / MIB


@linux_hwm
def test_temporary_in_an_exited_thread_does_not_pin_later_intervals(cpu):
    """A temporary of a thread that has exited: seen by its own interval only, whether or not the
    kernel folds the thread's mark into the process's rusage (this one does not)."""
    base = cpu.baseline()[1]
    worker = threading.Thread(target=touch_temporary, args=(128,))
    worker.start()
    worker.join()
    assert cpu.interval()[1] - base >= 120 * MIB
    for _ in range(3):
        quiet = cpu.interval()[1]
        assert quiet - base < 16 * MIB, (quiet - base) / MIB
    baseline = cpu.baseline()
    assert baseline[3] - baseline[1] < 16 * MIB


@linux_hwm
@pytest.mark.rss_sensitive
def test_each_interval_only_sees_its_own_temporary(returned_heap):
    # glibc's dynamic mmap threshold rises to the largest block an earlier test freed (up to 32 MiB):
    # pin it, as cpu_mmap_threshold does, so each temporary is mmapped and its pages really come and go;
    # and trim at every boundary, as cpu_mmap_threshold does too: a large free block earlier tests left
    # in the heap would otherwise take a temporary, and its pages would stay resident after it
    set_mmap_threshold(1 << 20)
    cpu = CpuBackend(trim_heap=True)
    base = cpu.baseline()[1]
    sizes = [32, 160, 0, 96]
    peaks = []
    for mib in sizes:
        touch_temporary(mib)
        peaks.append(cpu.interval()[1] - base)
    cpu.close()
    for mib, peak in zip(sizes, peaks):
        assert mib * MIB - 8 * MIB <= peak <= mib * MIB + 24 * MIB, (mib, peak / MIB)


@pytest.mark.rss_sensitive
def test_host_rss_reader_matches_psutil(returned_heap):
    read = host_rss_reader()
    assert abs(read() - rss()) < 4 * MIB
    before = read()
    live = torch.ones(64 * MIB, dtype=torch.uint8)
    grown = read()
    del live
    assert abs((grown - before) - 64 * MIB) < 8 * MIB, (grown - before) / MIB


def test_close_twice_is_safe_and_fork_reopens(cpu):
    cpu.baseline()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: /proc/self now names the child; the backend must notice and reopen
        code = 1
        try:
            os.close(read)
            base = cpu.baseline()[1]
            # fresh anonymous pages, touched: bytes from malloc could land in free heap pages the
            # parent left resident (inherited by the child), which raise no peak at all
            block = mmap.mmap(-1, 96 * MIB)
            block.write(b"\x01" * (96 * MIB))
            block.close()
            peak = cpu.interval()[1] - base
            ok = abs(base - psutil.Process().memory_info().rss) < 8 * MIB and (cpu.peak_source != "rss_high_water_mark" or peak >= 88 * MIB)
            os.write(write, f"{int(ok)} {peak // MIB}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    answer = os.read(read, 100).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert answer.startswith("1 "), answer
    cpu.close()
    cpu.close()


# ---------------------------------------------------------------------- CUDA (run on a GPU machine)
@pytest.mark.cuda
def test_cuda_backend_interval_peak_of_a_temporary():
    device = torch.device("cuda", torch.cuda.current_device())
    backend = select_backend(device)
    assert isinstance(backend, CudaBackend) and backend.kind == "cuda" and backend.peak_source == "allocator"
    allocated, reserved, _, _ = backend.baseline()
    assert allocated == torch.cuda.memory_allocated(device) and reserved == torch.cuda.memory_reserved(device)
    temp = torch.ones(256 * MIB, dtype=torch.uint8, device=device)
    del temp
    peak_allocated, peak_reserved = backend.interval()
    assert 256 * MIB <= peak_allocated - allocated < 258 * MIB
    assert peak_reserved >= peak_allocated
    quiet_allocated, _ = backend.interval()
    assert quiet_allocated - allocated < 1 * MIB


@pytest.mark.cuda
def test_cuda_backend_counters_and_capacity():
    backend = select_backend("cuda")
    backend.baseline()
    assert set(backend.counters()) == {"alloc_retries", "ooms", "inactive_split_bytes"}
    assert all(isinstance(v, int) and v >= 0 for v in backend.counters().values())
    capacity = backend.capacity()
    assert capacity is not None and 1 << 30 <= capacity <= torch.cuda.get_device_properties(backend.index).total_memory * 1.01


def test_a_cpu_backend_that_trims_pickles_and_trims_once_in_the_new_process():
    """``cpu_mmap_threshold``'s backend gives free heap chunks back once, at its first sampled step: pickled
    before it (a spawned rank, a copied monitor), it keeps that one trim to make; after it, none."""
    import pickle

    from memcallbacks._base.cpu import PEAK_RSS_HWM, CpuBackend, load_malloc_trim

    if load_malloc_trim() is None:
        pytest.skip("no glibc malloc_trim here")
    before = pickle.loads(pickle.dumps(CpuBackend(trim_heap=True)))
    assert before._trim is not None
    if before.peak_source != PEAK_RSS_HWM:
        pytest.skip("no resettable high-water mark here: peaks are sampled and the trim is not made")
    before.baseline()  # the first sampled step: the trim, once
    after = pickle.loads(pickle.dumps(before))
    assert before._trim is None and after._trim is None
    assert pickle.loads(pickle.dumps(CpuBackend()))._trim is None
