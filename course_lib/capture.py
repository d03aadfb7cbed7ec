"""CUDA graph capture with Python's cycle collector held off.

The collector runs whenever enough objects have been allocated, in the middle of a
capture too. If it then frees an old engine (engines hold reference cycles), that
engine's CUDA graphs are destroyed with it, and destroying a graph is not permitted
while a stream captures: the capture in progress fails with "operation failed due to a
previous error during capture". Seen on an H200 when a test built one engine after
another. Every capture in the package runs inside ``no_collection_while_capturing``.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_collection_while_capturing(collect_first: bool = False):
    """No cycle collection inside the block (restored after, as it was). ``collect_first``:
    collect once before it (an engine about to capture all its graphs frees any old
    engine's memory and graphs now, while nothing captures)."""
    if collect_first:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
