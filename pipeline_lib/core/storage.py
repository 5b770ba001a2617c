"""Storage through fsspec: filesystems from URIs, joins, checksums and write-then-publish helpers."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from pipeline_lib.core.errors import TfdagError, TransientError, UserError, is_transient
from pipeline_lib.core.object_stores import (
    bucket_of,
    describe_failure,
    fsspec_form,
    missing_bucket_message,
    mlflow_form,
    object_store,
    prepare_client,
    protocol_of,
    version_marker,  # noqa: F401  (re-exported: the stages reach every store through this module)
)
from pipeline_lib.core.secrets import (
    MASK,
    SecretReferenceError,
    is_masked,
    resolve_references,
)

logger = logging.getLogger(__name__)


class StorageError(TfdagError, RuntimeError):
    """A storage URI cannot be read or written; the message names the URI and the fix."""


class StorageUnavailable(StorageError, TransientError):
    """The storage endpoint did not answer or failed mid-transfer: a retry may succeed."""


class StorageAccessError(StorageError, UserError):
    """Refused credentials, a missing bucket, an unset variable or no matching file: fix the input."""


def expand_env(options: Any, where: str = "storage_options") -> Any:
    """Replace `${NAME}` in storage option strings with the environment variable NAME, and `${SCHEME:NAME}` with the
    secret of a registered store (`${prefect-secret:NAME}`: a Prefect Secret block; core.secrets.register_resolver).

    The one place a reference becomes its value: in the process that opens the storage. Configs (which travel as
    Prefect parameters, worker specs and MLflow records) hold the reference, or a mask, never the secret:
    `storage_options: {secret: "${AWS_SECRET_ACCESS_KEY}"}`.

    Raises:
        StorageAccessError: naming the option and the unset variable or unknown stored secret, or an option whose
            value was masked (a literal secret of a config that was stored, e.g. as a deployment's parameter).
    """
    if isinstance(options, dict):
        return {k: expand_env(v, f"{where}.{k}") for k, v in options.items()}
    if isinstance(options, list):
        return [expand_env(v, f"{where}[{i}]") for i, v in enumerate(options)]
    if is_masked(options):
        raise StorageAccessError(
            f"{where} holds {MASK}, a masked secret: the config was written literally with the secret and stored "
            "(a Prefect parameter or a run's record keep it masked); write it as a \"${VARIABLE}\" reference and "
            "set VARIABLE where the flow runs, or pass the config itself to the flow in this process")
    if isinstance(options, str) and "${" in options:
        def lookup(name: str) -> str:
            if name not in os.environ:
                raise StorageAccessError(f"{where} refers to the environment variable {name}, which is not set; "
                                   f"export {name} or change {where}")
            return os.environ[name]

        try:
            return resolve_references(options, where, lookup)
        except SecretReferenceError as error:
            raise StorageAccessError(str(error)) from None
    return options


def get_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path) for an fsspec URI; plain paths are local files; `${VAR}` options expanded.

    MLflow's Azure artifact form, `wasbs://container@account.blob.core.windows.net/path`, opens as
    `az://container/path`.
    """
    uri, options = fsspec_form(uri, expand_env(storage_options or {}))
    prepare_client(uri)
    return url_to_fs(uri, **options)


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


def unstrip(fs: fsspec.AbstractFileSystem, path: str, like_uri: str) -> str:
    """Turn a filesystem path back into a URI with the protocol of `like_uri`."""
    if is_local(like_uri):
        return path
    return f"{protocol_of(like_uri)}://{path.split('://', 1)[-1]}"


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


def _storage_error(error: BaseException, key: str, uri: str, options_key: str) -> StorageError:
    """Turn a storage client's exception into the StorageError of its kind (access or outage), naming the URI."""
    message = describe_failure(error, key, uri, options_key)
    unreachable = "cannot be reached" in message or isinstance(error, (ConnectionError, TimeoutError))
    if unreachable:
        return StorageUnavailable(message)
    return StorageAccessError(message)


def _missing_bucket(uri: str, key: str) -> StorageAccessError:
    return StorageAccessError(missing_bucket_message(uri, key))


def _bucket_exists(fs: fsspec.AbstractFileSystem, uri: str) -> bool:
    """Whether the bucket (container) of an object-store URI exists; errors other than not-found are raised."""
    try:
        fs.ls(bucket_of(uri), detail=False)
    except FileNotFoundError:
        return False
    return True


def _check_readable(key: str, uri: str, options: dict[str, Any], options_key: str) -> None:
    fs = None
    try:
        fs, path = get_fs(uri, options)
        found = fs.glob(path) if _has_glob(uri) else ([path] if fs.exists(path) else [])
        # exists() and glob() find nothing in a missing bucket too (and some clients hide a refused credential
        # there): ask the bucket itself for the precise cause.
        if not found and object_store(uri) is not None and not _bucket_exists(fs, uri):
            raise _missing_bucket(uri, key)
    except StorageError:
        raise
    except Exception as error:  # every client error becomes one StorageError naming the URI
        raise _check_failure(error, fs, key, uri, options_key) from error
    if not found:
        raise StorageAccessError(f"{key} ({uri!r}) matches no file; write the data there first (e.g. `tfdag demo-data "
                           f"{uri}`) or fix {key}")


def _check_writable(key: str, uri: str, options: dict[str, Any], options_key: str) -> None:
    import uuid

    probe = join(uri, f".tfdag-write-check-{uuid.uuid4().hex[:12]}")
    fs = None
    try:
        fs, path = get_fs(probe, options)
        if is_local(uri):
            fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, b"tfdag write check\n")
        fs.rm_file(path)
    except Exception as error:  # every client error becomes one StorageError naming the URI
        raise _check_failure(error, fs, key, uri, options_key) from error


def _check_failure(error: BaseException, fs: fsspec.AbstractFileSystem | None, key: str, uri: str,
                   options_key: str) -> StorageError:
    """The StorageError for a failed check. Each client says "not found" its own way for a missing bucket (or
    only for the object), so the bucket itself is asked; not after an outage, where asking would only wait out
    the client's retries again."""
    if fs is not None and object_store(uri) is not None and not is_transient(error):
        exists = True
        with contextlib.suppress(Exception):
            exists = _bucket_exists(fs, uri)
        if not exists:
            return _missing_bucket(uri, key)
    return _storage_error(error, key, uri, options_key)


def check_storage(config: Any) -> tuple[str, ...]:
    """Prove, before any training, that every storage URI of a pipeline config is usable.

    `data.source` must match at least one readable file (with `data.storage_options`); `output_root` and
    `tracking.artifact_location` (when set and tracking is enabled) must accept a small write and delete,
    with the top-level `storage_options` (the artifact location gets them only on the same object store as
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
        mlflow_artifact_uri(location)  # MLflow's own form of it can be made
        same = (object_store(location) or protocol_of(location)) == (object_store(config.output_root)
                                                                     or protocol_of(config.output_root))
        _check_writable("tracking.artifact_location", location, dict(config.storage_options) if same else {},
                        "storage_options")
        checked.append(location)
    logger.debug("storage check passed for %s", ", ".join(checked))
    return tuple(checked)


def mlflow_artifact_uri(uri: str, key: str = "tracking.artifact_location") -> str:
    """The URI in the form MLflow's own clients understand (an artifact root, a dataset source):
    `az://container/path` in MLflow's `wasbs://container@<account>.blob.core.windows.net/path` form, any other URI
    as it is.

    Raises:
        StorageAccessError: for an `az://` URI when the environment names no storage account (naming `key`).
    """
    formed, ok = mlflow_form(uri)
    if not ok:
        raise StorageAccessError(
            f"{key} ({uri!r}) is on Azure, and MLflow needs the storage account's name: set "
            "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME), or write the location as "
            "wasbs://<container>@<account>.blob.core.windows.net/<path>")
    return formed
