"""Python's garbage collector kept off what gradaudit did not make: ``collecting_only_new``.

A collection of the oldest generation looks at every object the process holds: tens of milliseconds
once transformers is imported, ~0.3 s with an 80-layer model loaded. CPython starts one whenever
enough objects have outlived the younger collections (a quarter more than the last full one left),
so an answer that makes many objects (an audit's records, a plan's steps, a report's JSON) pays for
the whole heap, often more than once.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

_depth = 0  # how many collecting_only_new blocks are open (the outermost alone freezes and unfreezes)
_lock = threading.Lock()


@contextlib.contextmanager
def collecting_only_new() -> Any:
    """Within the block, a garbage collection looks only at the objects made since it began (gc.freeze
    sets the older ones aside; nested blocks leave the outer one's freeze as it is); it misses only a
    garbage cycle through an older object, which the next full collection outside finds. ``audit``,
    ``Report.to_dict``, ``plan``, ``fit``, ``largest`` and the command line's call of a model factory
    run whole in one such block: Python's own collections of the oldest generation, which come when
    enough objects have been made, took ~0.3 s of each 80-layer plan, and one in the JSON of the
    80-layer audit 0.28 s where the document took 0.06.

    Only the outermost block asks whether anything is frozen (a freeze of the caller's own is left as it
    is): ``gc.get_freeze_count()`` walks every frozen object (~50 ms with an 80-layer model loaded and
    frozen), so the blocks nested in it count themselves instead."""
    global _depth
    with _lock:
        _depth += 1
        freeze = _depth == 1 and gc.get_freeze_count() == 0
    if freeze:
        # the young garbage first (a collection of the two younger generations: milliseconds), so that what
        # the freeze sets aside, and puts back among the oldest objects after, is alive or was old already
        gc.collect(1)
        gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if freeze:
                gc.unfreeze()
