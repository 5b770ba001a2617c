"""What differs between the object stores (S3, Google Cloud Storage, Azure Blob Storage), in one place.

`core.storage` asks this module; no stage asks which store a URI is on. Each store's entry says what its bucket is
called and how to create one, where its client finds the credentials and the endpoint, and the words its client's
errors use for a refused credential or a missing bucket. Adding a store is one more `ObjectStore` entry.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any


def protocol_of(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def bucket_of(uri: str) -> str:
    """The bucket (container) of an object-store URI; for `wasbs://container@account.host/...` the container."""
    return uri.split("://", 1)[-1].split("/", 1)[0].split("@", 1)[0]


@dataclass(frozen=True)
class ObjectStore:
    """One object store as tfdag sees it: what its bucket is called, how to make one, where its client finds the
    credentials and the endpoint, and the words its client uses for a refused credential or a missing bucket."""

    name: str
    protocols: tuple[str, ...]
    bucket_word: str
    create_bucket: str
    credentials: str
    endpoint: str
    refused: tuple[str, ...]
    missing_bucket: tuple[str, ...]


OBJECT_STORES = (
    ObjectStore(
        name="S3", protocols=("s3", "s3a"), bucket_word="bucket", create_bucket="aws s3 mb s3://{bucket}",
        credentials="AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the environment, or key / secret",
        endpoint="AWS_ENDPOINT_URL, or client_kwargs.endpoint_url",
        refused=("invalidaccesskeyid", "signaturedoesnotmatch", "accessdenied", "invalidtoken", "expiredtoken",
                 "unable to locate credentials", "nocredentials"),
        missing_bucket=("nosuchbucket", "bucket does not exist", "specified bucket")),
    ObjectStore(
        name="Google Cloud Storage", protocols=("gs", "gcs"), bucket_word="bucket",
        create_bucket="gcloud storage buckets create gs://{bucket}",
        credentials="GOOGLE_APPLICATION_CREDENTIALS in the environment (a service-account key file), or token",
        endpoint="STORAGE_EMULATOR_HOST, or endpoint_url",
        # gcsfs reads a key file it cannot use as a service account as an OAuth user token: KeyError 'refresh_token'
        refused=("invalid credentials", "anonymous caller", "defaultcredentialserror", "refresherror",
                 "invalid_grant", "refresh_token", "could not deserialize key", "unauthorized"),
        missing_bucket=("bucket does not exist",)),
    ObjectStore(
        name="Azure Blob Storage", protocols=("az", "abfs", "abfss", "wasbs", "wasb"), bucket_word="container",
        create_bucket="az storage container create --name {bucket}",
        credentials="AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY "
                    "or AZURE_STORAGE_SAS_TOKEN, in the environment, or connection_string / account_key",
        endpoint="the BlobEndpoint of AZURE_STORAGE_CONNECTION_STRING, or account_host",
        refused=("authenticationfailed", "authorizationfailure", "server failed to authenticate",
                 "authorizationpermissionmismatch", "invalid base64", "incorrect padding", "clientauthenticationerror"),
        missing_bucket=("containernotfound", "container does not exist")),
)
_GENERIC_REFUSED = ("access denied", "forbidden", "permission denied")
_UNREACHABLE = ("could not connect", "cannot connect", "connection refused", "endpointconnectionerror",
                "name or service not known", "timed out", "connecterror", "connect call failed")
# Keys of an fsspec `info()` that change when an object's content changes, in order of preference: S3's ETag,
# GCS's etag (its md5Hash on the emulator) and generation, Azure's etag, then times for local and memory files.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "created")


def object_store(uri: str) -> ObjectStore | None:
    """The object store a URI is on, or None for local, `memory://` and other fsspec filesystems."""
    protocol = protocol_of(uri)
    return next((store for store in OBJECT_STORES if protocol in store.protocols), None)


def version_marker(info: dict[str, Any]) -> str | None:
    """What changes in `fs.info(path)` when the object's content changes (ETag, generation or mtime)."""
    for key in _VERSION_KEYS:
        value = info.get(key)
        if value is not None:
            return str(value)
    return None


_WASBS = re.compile(r"^wasbs?://(?P<container>[^@/]+)@(?P<account>[^./]+)\.[^/]+/?(?P<path>.*)$")


def fsspec_form(uri: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The URI and options fsspec opens: MLflow's Azure form `wasbs://container@account.host/path` becomes
    `az://container/path` (adlfs has no `wasbs`), with the account from the URI unless the options or the
    environment name it."""
    match = _WASBS.match(uri)
    if not match:
        return uri, options
    options = dict(options)
    if not (options.get("connection_string") or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")):
        options.setdefault("account_name", match["account"])
    return f"az://{match['container']}/{match['path']}".rstrip("/"), options


def mlflow_form(uri: str) -> tuple[str, bool]:
    """(the artifact root MLflow understands for `uri`, whether it could be formed).

    `az://container/path` becomes MLflow's `wasbs://container@<account>.blob.core.windows.net/path`, the account
    taken from the AccountName of AZURE_STORAGE_CONNECTION_STRING or from AZURE_STORAGE_ACCOUNT_NAME (MLflow's
    client then uses that connection string, and so its endpoint); False when neither names one. Every other URI
    is returned as it is.
    """
    if protocol_of(uri) not in ("az", "abfs", "abfss"):
        return uri, True
    fields = dict(part.split("=", 1) for part in os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";")
                  if "=" in part)
    account = fields.get("AccountName") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        return uri, False
    container, _, path = uri.split("://", 1)[1].partition("/")
    return f"wasbs://{container}@{account}.blob.core.windows.net/{path}", True


def prepare_client(uri: str) -> None:
    """Settings a store's client must see before it is imported."""
    if protocol_of(uri) in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        # gcsfs asks Google's gRPC control API for each bucket's type (hierarchical or not); an emulator has no such
        # API, and each bucket then costs a long series of failed TLS handshakes before gcsfs falls back to plain GCS.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _chain(error: BaseException) -> list[BaseException]:
    """An error and the errors it was raised from."""
    chain, current = [], error
    while current is not None and all(current is not e for e in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def describe_failure(error: BaseException, key: str, uri: str, options_key: str) -> str:
    """Turn a storage client's exception into: what failed, on which URI, and the fix (no secret included)."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    chain = _chain(error)
    lowered = " | ".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    where = f"{key} ({uri!r})"
    store = object_store(uri)
    endpoint = store.endpoint if store else "the URI"
    unreachable = (f"the storage endpoint of {where} cannot be reached ({text}); check {endpoint} in the environment "
                   f"or {options_key}, and that the server is up")
    if any(isinstance(e, (ConnectionError, TimeoutError)) for e in chain):
        return unreachable
    source = store.credentials if store else "the environment"
    credentials = f"check the credentials: {source} (in {options_key} in the config)"
    refused = (*(store.refused if store else ()), *_GENERIC_REFUSED)
    if any(word in lowered for word in refused) or isinstance(error, PermissionError):
        return f"{where} refused the credentials ({text}); {credentials}"
    if any(word in lowered for word in (store.missing_bucket if store else ())):
        return missing_bucket_message(uri, key)
    if any(word in lowered for word in _UNREACHABLE):
        return unreachable
    return f"{where} cannot be used ({text}); check the URI, the credentials and {options_key}"


def missing_bucket_message(uri: str, key: str) -> str:
    """`the bucket 'x' of output_root ('gs://x/out') does not exist; create it (e.g. `...`) or fix output_root`."""
    store = object_store(uri)
    word, create = (store.bucket_word, store.create_bucket) if store else ("bucket", "")
    bucket = bucket_of(uri)
    how = f" (e.g. `{create.format(bucket=bucket)}`)" if create else ""
    return f"the {word} {bucket!r} of {key} ({uri!r}) does not exist; create it{how} or fix {key}"
