"""``import memcallbacks`` stays framework-free; ``memcallbacks.MemoryMonitor`` loads the Lightning adapter lazily."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def run_fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_pulls_in_no_framework():
    out = run_fresh(
        f"""
        import json, sys
        import memcallbacks
        import memcallbacks._base.config, memcallbacks._base.devices, memcallbacks._runtime.sampling, memcallbacks._files.outputs, memcallbacks._base.distributed
        config = memcallbacks.MonitorConfig(log_every_n_steps=2)
        print(json.dumps({{
            "frameworks": [m for m in {FRAMEWORKS!r} if m in sys.modules],
            "adapter_loaded": "memcallbacks.lightning" in sys.modules,
            "version": memcallbacks.__version__,
            "log_every": config.log_every_n_steps,
        }}))
        """
    )
    assert out["frameworks"] == []
    assert out["adapter_loaded"] is False
    assert out["version"] and out["log_every"] == 2


def test_memory_monitor_resolves_lazily():
    out = run_fresh(
        """
        import json, sys
        import memcallbacks
        before = "memcallbacks.lightning" in sys.modules or "lightning" in sys.modules
        listed = "MemoryMonitor" in dir(memcallbacks) and "MemoryMonitor" in memcallbacks.__all__
        cls = memcallbacks.MemoryMonitor
        import memcallbacks.lightning as adapter
        import lightning.pytorch as L, pytorch_lightning as pl
        try:
            memcallbacks.NoSuchThing
            missing = "no error"
        except AttributeError as exc:
            missing = str(exc)
        print(json.dumps({
            "before": before,
            "listed": listed,
            "same": cls is adapter.MemoryMonitor,
            "after": "memcallbacks.lightning" in sys.modules,
            "callbacks": [issubclass(cls, L.Callback), issubclass(cls, pl.Callback)],
            "missing": missing,
            "all_resolve": all(hasattr(memcallbacks, name) for name in memcallbacks.__all__),
        }))
        """
    )
    assert out["before"] is False
    assert out["listed"] is True
    assert out["same"] is True and out["after"] is True
    assert out["callbacks"] == [True, True]
    assert "NoSuchThing" in out["missing"]
    assert out["all_resolve"] is True
