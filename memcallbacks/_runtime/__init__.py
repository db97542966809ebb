"""The runtime (private): the session every adapter drives, its schedule, sampling and checks."""
