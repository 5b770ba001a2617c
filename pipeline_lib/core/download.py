"""Verified downloads: an object lands under its local name only once its digest (sha256 or BLAKE3) matches."""

from __future__ import annotations

import os
import uuid

import fsspec

from pipeline_lib.core import digests, storage


class ChecksumMismatch(storage.StorageError):
    """A downloaded object's digest differs from the one expected; it was not put in place."""

    def __init__(self, digest: str, num_bytes: int, algorithm: str = "sha256"):
        super().__init__(f"downloaded {num_bytes} bytes with {algorithm} {digest[:12]}…")
        self.digest = digest
        self.num_bytes = num_bytes
        self.algorithm = algorithm


def download_verified(fs: fsspec.AbstractFileSystem, remote_path: str, local_path: str, expected: str,
                      algorithm: digests.DigestAlgorithm | str = digests.DigestAlgorithm.SHA256) -> int:
    """Stream one object to a temporary file, hashing as it goes; rename it to `local_path` only if it verifies.

    The object is never held in memory, and `local_path` never holds a partial or wrong file.

    Args:
        expected: the hex digest the object must have, of `algorithm`.

    Returns:
        The number of bytes downloaded.

    Raises:
        ChecksumMismatch: the object's digest is not `expected` (nothing is left behind).
    """
    tmp = f"{local_path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    digest = digests.new_digest(algorithm)
    size = 0
    try:
        with fs.open(remote_path, "rb", block_size=digests.CHUNK_BYTES) as source, open(tmp, "wb") as target:
            for chunk in iter(lambda: source.read(digests.CHUNK_BYTES), b""):
                digest.update(chunk)
                target.write(chunk)
                size += len(chunk)
        if digest.hexdigest() != expected:
            raise ChecksumMismatch(digest.hexdigest(), size, digests.DigestAlgorithm(algorithm).value)
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return size
