"""``watch_host``: the host channel's on/off switch (MonitorConfig), honoured where the session builds it."""

from __future__ import annotations

import torch

from memcallbacks import Monitor

HOST_KEYS = {"memory/host_python_GiB", "memory/host_private_GiB", "memory/host_workers_GiB"}
READ = {"memory/host_python_GiB", "memory/host_private_GiB"}  # workers' key: NaN without workers, not logged


def _fit(**config):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    logged: list[dict[str, float]] = []
    monitor = Monitor(model, opt, lambda metrics, step: logged.append(metrics), write_files=False, log_every_n_steps=1,
                      device="cpu", log_keys="all", **config)
    for _ in monitor.track(range(6)):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor, logged


def test_host_channel_on_by_default_reads_and_logs_its_keys():
    monitor, logged = _fit()
    host = monitor.report()["host"]
    assert host is not None and host["enabled"] and host["reads"] >= 1
    assert logged and READ <= set(logged[-1])
    assert "host_private_bytes" in monitor.report()["summary"]["rank_figures"]


def test_watch_host_false_builds_no_host_channel():
    monitor, logged = _fit(watch_host=False)
    report = monitor.report()
    assert report["host"] is None
    assert report["config"]["watch_host"] is False
    assert logged and not HOST_KEYS & set(logged[-1])
    assert not any(k.startswith("host_") for k in report["summary"]["rank_figures"])
    assert monitor._current_session().checks.host is None
