"""The runtime (private): the session every adapter drives and all step wiring — the step plan, sampling, the leak watch, snapshots, the theory and pre-flight checks."""
