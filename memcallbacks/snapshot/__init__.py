"""Memory snapshots: CUDA recording, CPU capture, summary, offline render, auto-snapshot policy."""
