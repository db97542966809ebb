"""The writer process (``memcallbacks._files.writer_process``) with a slow plot stage, for tests/scripts/ddp_end_write.py.

``history_figure`` sleeps ``$DDP_END_WRITE_SLOW_S`` seconds first: a slow disk, a busy host; with
``$END_WRITER_PLOT_FAULT`` set it raises instead (a plot that fails in the writer).
"""

from __future__ import annotations

import os
import time

import memcallbacks._files.outputs as outputs
from memcallbacks._files.writer_process import main

_figure = outputs.history_figure


def slow_figure(*args, **kwargs):
    if os.environ.get("END_WRITER_PLOT_FAULT"):
        raise KeyError("injected plot fault in the writer")
    time.sleep(float(os.environ.get("DDP_END_WRITE_SLOW_S") or 0))
    return _figure(*args, **kwargs)


outputs.history_figure = slow_figure

if __name__ == "__main__":
    os._exit(main())
