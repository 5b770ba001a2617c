"""Verified downloads: an object lands under its local name only once its sha256 matches."""

from __future__ import annotations

import hashlib
import os
import uuid

import fsspec

from pipeline_lib.core import storage


class ChecksumMismatch(storage.StorageError):
    """A downloaded object's sha256 differs from the one expected; it was not put in place."""

    def __init__(self, digest: str, num_bytes: int):
        super().__init__(f"downloaded {num_bytes} bytes with sha256 {digest[:12]}…")
        self.digest = digest
        self.num_bytes = num_bytes


def download_verified(fs: fsspec.AbstractFileSystem, remote_path: str, local_path: str, sha256: str) -> int:
    """Stream one object to a temporary file, hashing as it goes; rename it to `local_path` only if it verifies.

    The object is never held in memory, and `local_path` never holds a partial or wrong file.

    Returns:
        The number of bytes downloaded.

    Raises:
        ChecksumMismatch: the object's sha256 is not `sha256` (nothing is left behind).
    """
    tmp = f"{local_path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    size = 0
    try:
        with fs.open(remote_path, "rb", block_size=storage.CHUNK_BYTES) as source, open(tmp, "wb") as target:
            for chunk in iter(lambda: source.read(storage.CHUNK_BYTES), b""):
                digest.update(chunk)
                target.write(chunk)
                size += len(chunk)
        if digest.hexdigest() != sha256:
            raise ChecksumMismatch(digest.hexdigest(), size)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return size
