"""Where tfdag keeps its local caches: the cache root every stage shares."""

from __future__ import annotations

import os

CACHE_ENV = "TFDAG_CACHE_DIR"


def default_cache_dir() -> str:
    """`$TFDAG_CACHE_DIR`, else `~/.cache/tfdag`: the root of every local cache tfdag keeps."""
    return os.path.abspath(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tfdag"))
