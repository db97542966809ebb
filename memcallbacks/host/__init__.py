"""The host channel's library parts: cheap host reads, host growth, the host census, DataLoader
workers and per-rank imbalance. Framework-free (torch, psutil, the standard library); see docs/host.md."""

from memcallbacks._base.cpu import StatmReader, pymalloc_arena_bytes, pymalloc_bytes
from memcallbacks.host.census import HolderGrowth, HostCensus, HostExplanation, TracemallocWindow, explain_host_growth, take_host_census
from memcallbacks.host.channel import HostReader
from memcallbacks.host.growth import BYTES_PER_BLOCK, HostGrowth, HostReading
from memcallbacks.host.ranks import find_imbalance, gather_figures
from memcallbacks.host.readers import measure_costs, python_object_blocks, smaps_rollup
from memcallbacks.host.workers import WorkerInfo, WorkerWatch, dataloader_workers

__all__ = [
    "BYTES_PER_BLOCK",
    "HolderGrowth",
    "HostCensus",
    "HostExplanation",
    "HostGrowth",
    "HostReader",
    "HostReading",
    "StatmReader",
    "TracemallocWindow",
    "WorkerInfo",
    "WorkerWatch",
    "dataloader_workers",
    "explain_host_growth",
    "find_imbalance",
    "gather_figures",
    "measure_costs",
    "pymalloc_arena_bytes",
    "pymalloc_bytes",
    "python_object_blocks",
    "smaps_rollup",
    "take_host_census",
]
