"""A frozen heap made visible to the holder searches for as long as they run.

``gc.get_objects()`` and ``gc.get_referrers()`` do not list frozen objects (``gc.freeze()``, which
the pytest plugin uses after warm-up to keep its end-of-test collection cheap, and which some
servers call after start-up). A finding's holders searched on a frozen heap come back empty: a
Lightning module appending its loss to ``self.kept`` under the plugin was reported as a chain of
graphs with 0 B and no holder. The chain's root and holder search runs with the heap thawed and
freezes it again after (only there: a chain is rare and always a leak; the plugin's own censuses
thaw the heap themselves).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["visible_heap"]


@contextlib.contextmanager
def visible_heap() -> Iterator[None]:
    """Thaw a frozen heap for the duration of the block, then freeze again (nothing to do when none is frozen).

    Freezing again also freezes what was made since the first freeze: a collection after it looks
    at fewer objects, which is what freezing is for."""
    if gc.get_freeze_count() == 0:
        yield
        return
    gc.unfreeze()
    try:
        yield
    finally:
        gc.freeze()
