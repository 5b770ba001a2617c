"""The demo's real data: scikit-learn's bundled 8x8 digits written as CSV to any fsspec URI (no download)."""

from __future__ import annotations

import io
import logging
from typing import Any

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.data.errors import raise_if_outage

logger = logging.getLogger(__name__)

NUM_PIXELS = 64
LABEL = "target"


def digits_csv_bytes() -> bytes:
    """The 1797 digits as CSV: a header `pixel_0..pixel_63,target`, pixels as floats, the digit as an int."""
    # Imported here: scikit-learn is slow to import and only the demo needs it. It reads a bundled file, no download.
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = io.StringIO()
    out.write(",".join([*(f"pixel_{i}" for i in range(NUM_PIXELS)), LABEL]) + "\n")
    for pixels, target in zip(digits.data, digits.target):
        # Floats keep a decimal point so conversion infers float32 features, not int64.
        out.write(",".join(f"{float(v):.1f}" for v in pixels) + f",{int(target)}\n")
    return out.getvalue().encode()


def write_digits_csv(uri: str, storage_options: dict[str, Any] | None = None) -> str:
    """Write the digits CSV to `uri` (local path or any fsspec URL, e.g. s3://bucket/raw/digits.csv).

    Args:
        uri: destination file.
        storage_options: fsspec options for `uri`.

    Returns:
        `uri`.

    Raises:
        storage.StorageError: when the destination cannot be written; names the URI.
        storage.StorageUnavailable: when the storage does not answer (a retry may succeed).
    """
    fs, path = storage.get_fs(uri, storage_options)
    try:
        storage.write_bytes_atomic(fs, path, digits_csv_bytes())
    except OSError as error:
        raise_if_outage(error, uri, "writing the digits CSV to")
        raise storage.StorageError(
            f"cannot write the digits CSV to {uri!r} ({type(error).__name__}: {error}); check the path, the "
            "bucket and its credentials"
        ) from None
    logger.info("demo-data | wrote the 8x8 digits (1797 rows) to %s", uri)
    return uri


def ensure_digits_csv(uri: str, storage_options: dict[str, Any] | None = None) -> str:
    """Write the digits CSV to `uri` only when nothing is there yet (the demo's first run); returns `uri`."""
    fs, path = storage.get_fs(uri, storage_options)
    if fs.exists(path):
        logger.debug("demo-data | %s exists; keeping it", uri)
        return uri
    return write_digits_csv(uri, storage_options)


DEMO_FILE_NAME = "digits.csv"


def ensure_demo_source(data: DataConfig) -> bool:
    """The demo configs read `digits.csv`: write the bundled digits there on first use (no download).

    Returns True when the source is the demo file (written now or already present).
    """
    if not data.source.rstrip("/").endswith(DEMO_FILE_NAME):
        return False
    ensure_digits_csv(data.source, data.storage_options)
    return True
