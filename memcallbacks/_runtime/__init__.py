"""The session every adapter drives: devices, phase sampling, distributed, outputs (private)."""
