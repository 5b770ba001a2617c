"""The conversion's optional C loops (`_native.c`): TFRecord payload CRCs, the split hash, the statistics and the
CSV parse of plain values.

`module` is the compiled extension, or None where it was not built (no compiler at install time); callers then
take their pure-Python path (Arrow's parse for CSV), which writes the same bytes. Tests set `module = None` to
exercise that path.
"""

from __future__ import annotations

try:
    from pipeline_lib.core import _native as module
except ImportError:  # pragma: no cover - only where the optional extension was not built
    module = None


def describe() -> str:
    """One line for logs and benchmarks: which loops conversion runs."""
    if module is None:
        return "pure Python (the _native extension is not built)"
    crc = f"{module.crc_loop()} CRC32C"
    loop = getattr(module, "statistics_loop", None)  # None: an extension built before it (not reinstalled yet)
    statistics = f"{loop() if loop else 'portable'} statistics"
    return f"C (_native), {crc}, {statistics}"
