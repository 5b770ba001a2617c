"""The conversion's optional C loops (`_native.c`): TFRecord payload CRCs, the split hash, the statistics and the
CSV parse of plain values.

`module` is the compiled extension, or None where it was not built (no compiler at install time); callers then
take their pure-Python path (Arrow's parse for CSV), which writes the same bytes. Tests set `module = None` to
exercise that path. Without the extension, importing this module logs one warning naming what is slower and the
fix: it is imported once per process, by the first import of the conversion path, so the warning comes once.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Where the extension failed to build, the conversion still works, only much slower: that must never pass unseen.
# Logged on import, once per process: `tfdag` configures logging before a command imports the conversion path,
# and a process with no handler still prints a warning (logging's last resort).
MISSING_WARNING = (
    "the C extension pipeline_lib.core._native did not load (%s): conversion runs its pure-Python loops (record "
    "framing and CRCs, the split hash, the statistics, the CSV parse), which write the same bytes but are much "
    "slower. Fix: install a C compiler and the Python headers (e.g. apt-get install gcc python3-dev), then run "
    "`make install` again (or `pip install -e .` in this environment)")

try:
    from pipeline_lib.core import _native as module
except ImportError as error:  # pragma: no cover - only where the optional extension was not built
    module = None
    logger.warning(MISSING_WARNING, error)


def describe() -> str:
    """One line for logs and benchmarks: which loops conversion runs."""
    if module is None:
        return "pure Python (the _native extension is not built)"
    return f"C (_native), {module.crc_loop()} CRC32C, {module.statistics_loop()} statistics"
