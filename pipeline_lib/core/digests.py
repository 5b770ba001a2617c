"""File digests by algorithm name: the one place that maps a manifest's digest algorithm to a hash function.

A dataset manifest names the algorithm of its shards' digests (`Manifest.shard_digest`; absent in manifests
written before it existed, which means sha256). Conversion writes BLAKE3: it hashes faster than sha256 on one
thread, even against SHA-NI, and the digest of every shard byte was the largest single phase of a conversion
(`make bench`, bench/results.json). Every verifier (staging, the rerun's check, verified downloads) calls
`new_digest` or `file_digest` with the manifest's algorithm, so old manifests keep verifying.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, Protocol

import blake3

# Bytes read at a time when a file is streamed: through a digest here, and by a verified download
# (core.download), which hashes what it copies.
CHUNK_BYTES = 4 << 20


class DigestAlgorithm(str, enum.Enum):
    SHA256 = "sha256"
    BLAKE3 = "blake3"


class Digest(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_digest(algorithm: DigestAlgorithm | str = DigestAlgorithm.SHA256) -> Digest:
    """A fresh hash object of `algorithm`; its `update` releases the GIL for large buffers.

    Raises:
        ValueError: for an algorithm name this version does not know (a manifest from a newer tfdag).
    """
    try:
        algorithm = DigestAlgorithm(algorithm)
    except ValueError:
        raise ValueError(f"digest algorithm {algorithm!r} is not one of {[a.value for a in DigestAlgorithm]}; "
                         "the manifest was written by a newer tfdag: upgrade it, or convert the data again") from None
    if algorithm == DigestAlgorithm.BLAKE3:
        # One thread: conversion hashes beside its other threads, and BLAKE3's own pool would only compete
        # with them for the same two cores.
        return blake3.blake3(max_threads=1)
    return hashlib.sha256()


def file_digest(fs: Any, path: str, algorithm: DigestAlgorithm | str = DigestAlgorithm.SHA256) -> str:
    """The hex digest of the file at `path` on the fsspec filesystem `fs`, streamed (never held in memory).

    `fs` None: `path` is local and is opened without fsspec's layer.
    """
    digest = new_digest(algorithm)
    with (open(path, "rb") if fs is None else fs.open(path, "rb")) as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def local_file_digest(path: str, algorithm: DigestAlgorithm | str = DigestAlgorithm.SHA256) -> str:
    """The hex digest of a local file, streamed."""
    return file_digest(None, path, algorithm)
