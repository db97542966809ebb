"""Leak detection and attribution: growth, lingering references, cycles, the census, holders."""

from memcallbacks.leaks.census import Census, take_census
from memcallbacks.leaks.holders import find_holders

__all__ = ["Census", "find_holders", "take_census"]
