"""Storage through fsspec: filesystems from URIs, joins, checksums and write-then-publish helpers."""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
from typing import Any, Iterator

import fsspec
from fsspec.core import url_to_fs

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


class StorageError(RuntimeError):
    """A storage URI cannot be read or written; the message names the URI and the fix."""


def get_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path) for an fsspec URI; plain paths are local files."""
    return url_to_fs(uri, **(storage_options or {}))


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    """The absolute local path of a local URI."""
    return os.path.abspath(uri.removeprefix("file://"))


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI, keeping its protocol."""
    if is_local(uri):
        return os.path.join(uri, *parts)
    return posixpath.join(uri, *parts)


def protocol_of(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def unstrip(fs: fsspec.AbstractFileSystem, path: str, like_uri: str) -> str:
    """Turn a filesystem path back into a URI with the protocol of `like_uri`."""
    if is_local(like_uri):
        return path
    return f"{protocol_of(like_uri)}://{path.split('://', 1)[-1]}"


def sha256_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """Stream a file through sha256 without holding it in memory."""
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_local(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file so that readers see either the old content or the whole new one.

    Local filesystems get a rename; object stores upload a single object, which is atomic.
    """
    parent = posixpath.dirname(path) if not isinstance(fs, fsspec.implementations.local.LocalFileSystem) else os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    else:
        with fs.open(path, "wb") as handle:
            handle.write(data)


def upload_tree(local_dir: str, fs: fsspec.AbstractFileSystem, remote_dir: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy every file under local_dir to remote_dir (streamed), returning the relative paths."""
    copied = []
    for relative in iter_files(local_dir):
        if os.path.basename(relative) in skip:
            continue
        target = posixpath.join(remote_dir, relative.replace(os.sep, "/"))
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.put_file(os.path.join(local_dir, relative), target)
        copied.append(relative)
    return copied


def iter_files(local_dir: str) -> Iterator[str]:
    """Relative paths of every file under a local directory, sorted."""
    found = []
    for root, _dirs, files in os.walk(local_dir):
        for name in files:
            found.append(os.path.relpath(os.path.join(root, name), local_dir))
    yield from sorted(found)


import fsspec.implementations.local  # noqa: E402  (registers LocalFileSystem for isinstance checks)
