"""The writer process (``memcallbacks._files.writer_process``) with a slow plot stage, for tests/scripts/ddp_end_write.py.

``history_figure`` sleeps ``$DDP_END_WRITE_SLOW_S`` seconds first: a slow disk, a busy host.
"""

from __future__ import annotations

import os
import time

import memcallbacks._files.outputs as outputs
from memcallbacks._files.writer_process import main

_figure = outputs.history_figure


def slow_figure(*args, **kwargs):
    time.sleep(float(os.environ["DDP_END_WRITE_SLOW_S"]))
    return _figure(*args, **kwargs)


outputs.history_figure = slow_figure

if __name__ == "__main__":
    os._exit(main())
