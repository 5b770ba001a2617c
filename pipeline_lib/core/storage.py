"""Storage through fsspec: filesystems from URIs, joins, checksums and write-then-publish helpers."""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from pipeline_lib.core.errors import TfdagError, TransientError, UserError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


class StorageError(TfdagError, RuntimeError):
    """A storage URI cannot be read or written; the message names the URI and the fix."""


class StorageUnavailable(StorageError, TransientError):
    """The storage endpoint did not answer or failed mid-transfer: a retry may succeed."""


class StorageAccessError(StorageError, UserError):
    """Refused credentials, a missing bucket, an unset variable or no matching file: fix the input."""


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(options: Any, where: str = "storage_options") -> Any:
    """Replace `${NAME}` in storage option strings with the environment variable NAME.

    Configs (which travel as Prefect parameters and worker specs) then hold a reference, never the secret:
    `storage_options: {secret: "${AWS_SECRET_ACCESS_KEY}"}`.

    Raises:
        StorageError: naming the option and the unset variable.
    """
    if isinstance(options, dict):
        return {k: expand_env(v, f"{where}.{k}") for k, v in options.items()}
    if isinstance(options, list):
        return [expand_env(v, f"{where}[{i}]") for i, v in enumerate(options)]
    if isinstance(options, str) and "${" in options:
        def lookup(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise StorageAccessError(f"{where} refers to the environment variable {name}, which is not set; "
                                   f"export {name} or change {where}")
            return os.environ[name]

        return _ENV_REFERENCE.sub(lookup, options)
    return options


def get_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path) for an fsspec URI; plain paths are local files; `${VAR}` options expanded."""
    return url_to_fs(uri, **expand_env(storage_options or {}))


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


def fsync_dir(path: str) -> None:
    """Make a local directory's entries (files created or renamed into it) durable; a no-op where the OS
    cannot open directories (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        fsync_dir(os.path.dirname(path) or ".")
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


import fsspec.implementations.local


def _has_glob(uri: str) -> bool:
    return any(c in uri for c in "*?[")


def _bucket_of(uri: str) -> str:
    return uri.split("://", 1)[-1].split("/", 1)[0]


def _storage_error(error: BaseException, key: str, uri: str, options_key: str) -> StorageError:
    """Turn a storage client's exception into the StorageError of its kind (access or outage), naming the URI."""
    message = _describe_failure(error, key, uri, options_key)
    unreachable = "cannot be reached" in message or isinstance(error, (ConnectionError, TimeoutError))
    if unreachable:
        return StorageUnavailable(message)
    return StorageAccessError(message)


def _describe_failure(error: BaseException, key: str, uri: str, options_key: str) -> str:
    """Turn a storage client's exception into: what failed, on which URI, and the fix (no secret included)."""
    text = f"{type(error).__name__}: {error}"
    lowered = text.lower()
    where = f"{key} ({uri!r})"
    credentials = (f"check the credentials: the environment (AWS_ACCESS_KEY_ID / AWS_PROFILE, "
                   f"GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*) or {options_key} in the config")
    if any(word in lowered for word in ("invalidaccesskeyid", "signaturedoesnotmatch", "accessdenied",
                                        "access denied", "forbidden", "invalidtoken", "expiredtoken",
                                        "unable to locate credentials", "nocredentials")) \
            or isinstance(error, PermissionError):
        return f"{where} refused the credentials ({text}); {credentials}"
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered or "specified bucket" in lowered:
        return (f"the bucket {_bucket_of(uri)!r} of {where} does not exist; create it (e.g. `aws s3 mb "
                f"s3://{_bucket_of(uri)}`) or fix {key}")
    if any(word in lowered for word in ("could not connect", "connection refused", "endpointconnectionerror",
                                        "name or service not known", "timed out", "connecterror")):
        return (f"the storage endpoint of {where} cannot be reached ({text}); check AWS_ENDPOINT_URL or "
                f"{options_key} (client_kwargs.endpoint_url) and that the server is up")
    return f"{where} cannot be used ({text}); check the URI, the credentials and {options_key}"


def _check_readable(key: str, uri: str, options: dict[str, Any], options_key: str) -> None:
    try:
        fs, path = get_fs(uri, options)
        found = fs.glob(path) if _has_glob(uri) else ([path] if fs.exists(path) else [])
        if not found and not is_local(uri):
            # exists() is False for a missing bucket too: ask the bucket itself for the precise cause.
            fs.ls(_bucket_of(uri) if protocol_of(uri) in ("s3", "s3a", "gs", "gcs", "az", "abfs") else path)
    except Exception as error:  # every client error becomes one StorageError naming the URI
        raise _storage_error(error, key, uri, options_key) from error
    if not found:
        raise StorageAccessError(f"{key} ({uri!r}) matches no file; write the data there first (e.g. `tfdag demo-data "
                           f"{uri}`) or fix {key}")


def _check_writable(key: str, uri: str, options: dict[str, Any], options_key: str) -> None:
    import uuid

    probe = join(uri, f".tfdag-write-check-{uuid.uuid4().hex[:12]}")
    try:
        fs, path = get_fs(probe, options)
        if is_local(uri):
            fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, b"tfdag write check\n")
        fs.rm_file(path)
    except Exception as error:  # every client error becomes one StorageError naming the URI
        raise _storage_error(error, key, uri, options_key) from error


def check_storage(config: Any) -> tuple[str, ...]:
    """Prove, before any training, that every storage URI of a pipeline config is usable.

    `data.source` must match at least one readable file (with `data.storage_options`); `output_root` and
    `tracking.artifact_location` (when set and tracking is enabled) must accept a small write and delete,
    with the top-level `storage_options` (the artifact location gets them only on the same protocol as
    output_root; MLflow's own client reads its credentials from the environment).

    Args:
        config: the PipelineConfig.

    Returns:
        The URIs checked.

    Raises:
        StorageError: naming the config key, the URI, what failed (refused credentials, missing bucket,
            unreachable endpoint, no matching file) and the fix; never a credential.
    """
    checked = []
    _check_readable("data.source", config.data.source, dict(config.data.storage_options), "data.storage_options")
    checked.append(config.data.source)
    _check_writable("output_root", config.output_root, dict(config.storage_options), "storage_options")
    checked.append(config.output_root)
    location = config.tracking.artifact_location
    if config.tracking.enabled and location:
        same = protocol_of(location) == protocol_of(config.output_root)
        _check_writable("tracking.artifact_location", location, dict(config.storage_options) if same else {},
                        "storage_options")
        checked.append(location)
    logger.debug("storage check passed for %s", ", ".join(checked))
    return tuple(checked)
