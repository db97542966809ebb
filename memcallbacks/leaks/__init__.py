"""Leak detection and attribution: growth, lingering references, cycles, the tensor census."""
