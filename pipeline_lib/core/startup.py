"""A tfdag process's start-up imports, kept out of the cyclic garbage collector's work.

TensorFlow, Prefect and MLflow leave hundreds of thousands of objects that live as long as the process. A full
collection walks every one of them, and imports allocate enough to set off several: left alone, the collector takes
seconds of a short `tfdag run`. `imports()` turns it off while a block imports (imports make almost no cyclic
garbage), then moves everything alive out of its reach (`gc.freeze`) and turns it back on, so later collections walk
only what the work itself makes. Training workers freeze the same way after their imports (`launch.worker`,
`launch.forkserver`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def settle() -> None:
    """Everything alive now out of the collector's reach: what the process's imports made stays for its life."""
    gc.freeze()


@contextlib.contextmanager
def imports() -> Iterator[None]:
    """Run the block with the collector off, then `settle()` and restore the collector as it was before the block
    (a block inside another leaves it off for the outer one)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        settle()
        if was_enabled:
            gc.enable()
