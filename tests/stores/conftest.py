"""Three real object-store APIs for the tests, each on a free 127.0.0.1 port, and the `store` fixture over them.

- S3: moto's server mode, in this process (its backends are in-process state); clients find it through the
  standard `AWS_ENDPOINT_URL` variable, with dummy credentials.
- Google Cloud Storage: `gcp-storage-emulator`, a child process; gcsfs and google-cloud-storage (MLflow's client)
  find it through `STORAGE_EMULATOR_HOST` and use no credentials.
- Azure Blob Storage: Azurite, a child process; adlfs and azure-storage-blob (MLflow's client) find it through
  `AZURE_STORAGE_CONNECTION_STRING` with Azurite's well-known development account.

Each can be stopped (an outage: connections are refused) and started again on the same port with every bucket and
object still there. A missing emulator skips the tests on its store, naming it; under CI=true it fails them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

from pipeline_lib.core.net import free_port
from tests.stores import emulators

BUCKET = "tfdag-demo"
ACCESS_KEY = "testing"
SECRET_KEY = "testing-secret-value"


class S3Server(ThreadedMotoServer):
    """moto in server mode with a request hook, and a stop that really closes the port (an outage)."""

    def __init__(self, port: int):
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.request_hook: Callable[[dict], None] | None = None
        self.running = False
        self._lock = threading.Lock()

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)

        def hooked(environ, start_response):
            hook = self.request_hook
            if hook is not None:
                hook(environ)
            return app(environ, start_response)

        self._server = make_server(self._ip_address, self._port, hooked, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        with self._lock:
            if not self.running:
                super().start()
                self.running = True

    def stop(self) -> None:
        with self._lock:
            if self.running:
                super().stop()
                self._server.server_close()  # refuse connections instead of queueing them
                self.running = False


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 API server; the environment points every S3 client (s3fs, boto3, MLflow) at it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = S3Server(free_port())
    server.start()
    patch = pytest.MonkeyPatch()
    patch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    patch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    patch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "MLFLOW_S3_ENDPOINT_URL"):
        patch.delenv(name, raising=False)
    try:
        yield server
    finally:
        patch.undo()
        server.stop()


@pytest.fixture(scope="session")
def gs_server(tmp_path_factory) -> Iterator[emulators.EmulatorProcess]:
    """The session's Google Cloud Storage emulator; the environment points gcsfs and google-cloud-storage at it."""
    if not emulators.gcs_emulator_installed():
        _missing("gcp-storage-emulator is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    server = emulators.gcs_emulator(free_port(), tmp_path_factory.mktemp("gcs") / "data")
    server.start()
    patch = pytest.MonkeyPatch()
    patch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.port}")
    patch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    patch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    try:
        yield server
    finally:
        patch.undo()
        server.stop()


@pytest.fixture(scope="session")
def az_server(tmp_path_factory) -> Iterator[emulators.EmulatorProcess]:
    """The session's Azurite; the environment points adlfs and azure-storage-blob at it (development account)."""
    command = emulators.azurite_command()
    if command is None:
        _missing("Azurite is not installed (`make test` runs .ci/install-test-deps, which installs it with npm into "
                 ".tfdag-test-tools/; it needs Debian's nodejs and npm)")
    server = emulators.azurite(free_port(), tmp_path_factory.mktemp("azurite") / "data", command)
    server.start()
    patch = pytest.MonkeyPatch()
    patch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                 emulators.azurite_connection_string(f"http://127.0.0.1:{server.port}"))
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        patch.delenv(name, raising=False)
    try:
        yield server
    finally:
        patch.undo()
        server.stop()


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}: under CI=true a missing part fails the run")
    pytest.skip(what)


def _clear_fs_caches() -> None:
    """Forget cached filesystem instances and their listings (a test may have stopped and started a server)."""
    import sys

    # Only the clients already imported: gcsfs must first be imported with the emulator's settings in place.
    for module, name in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem"), ("adlfs", "AzureBlobFileSystem")):
        if module in sys.modules:
            getattr(sys.modules[module], name).clear_instance_cache()


@dataclass
class StoreHandle:
    """What a test gets: the store's protocol, its bucket, a fresh fsspec client, and its server's stop and start."""

    protocol: str
    bucket: str
    fs: Any
    server: Any
    # The options that carry a credential on this store, and the secret they hold (None: the store takes none).
    secret: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # (options the store accepts, options with a wrong credential, the wrong secret), set up on demand.
    credentials_fn: Callable[[Any, Any], tuple[dict, dict, str]] | None = None
    # Whether the client itself retries a refused connection for longer than a short outage (gcsfs: 6 tries with
    # backoff, the Azure SDK: 3 with 15 s or more between them); s3fs is told to try once in the outage test.
    client_rides_out_outages: bool = True

    def wrong_credentials(self, tmp_path, monkeypatch) -> tuple[dict, dict, str]:
        return self.credentials_fn(tmp_path, monkeypatch)

    def uri(self, path: str = "") -> str:
        return f"{self.protocol}://{self.bucket}/{path}".rstrip("/")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `<bucket>/<prefix>`, fresh from the server (no listing cache)."""
        self.fs.invalidate_cache()
        root = f"{self.bucket}/{prefix}".rstrip("/")
        if not self.fs.exists(root):
            return []
        return sorted(p.removeprefix(f"{self.bucket}/") for p in self.fs.find(root))

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


def _fresh_bucket(fs, bucket: str) -> None:
    """An empty bucket: every object under it removed, the bucket created when missing."""
    fs.invalidate_cache()
    if fs.exists(bucket):
        found = fs.find(bucket)
        if found:
            fs.rm(found)
    else:
        fs.mkdir(bucket)
    fs.invalidate_cache()


def _s3_handle(request) -> StoreHandle:
    import boto3
    import s3fs

    server = request.getfixturevalue("s3_server")
    server.start()
    server.request_hook = None
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"))
    _clear_fs_caches()
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return StoreHandle(protocol="s3", bucket=BUCKET, fs=s3fs.S3FileSystem(skip_instance_cache=True), server=server,
                       secret=SECRET_KEY, options={"key": ACCESS_KEY, "secret": SECRET_KEY},
                       credentials_fn=_s3_credentials, client_rides_out_outages=False)


def _s3_credentials(tmp_path, monkeypatch) -> tuple[dict, dict, str]:
    """An IAM user's key, then moto checks every request's signature against its IAM users."""
    import json

    import boto3
    from moto import settings

    iam = boto3.client("iam")
    iam.create_user(UserName="tfdag")
    iam.put_user_policy(UserName="tfdag", PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    good = iam.create_access_key(UserName="tfdag")["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    wrong = {"key": "AKIAWRONGWRONGWRONG1", "secret": "not-the-secret-value-xyz"}
    return {"key": good["AccessKeyId"], "secret": good["SecretAccessKey"]}, wrong, wrong["secret"]


def _gs_handle(request) -> StoreHandle:
    server = request.getfixturevalue("gs_server")
    server.start()
    _clear_fs_caches()
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
    _fresh_bucket(fs, BUCKET)
    # The emulator accepts any request: no credential to carry.
    return StoreHandle(protocol="gs", bucket=BUCKET, fs=fs, server=server, credentials_fn=_gs_credentials)


def _gs_credentials(tmp_path, monkeypatch) -> tuple[dict, dict, str]:
    """The emulator checks no credential, so the wrong one is a key file gcsfs cannot use (a service-account
    key whose private key is not a key): refused by the client before any request."""
    import json

    secret = "-----BEGIN PRIVATE KEY-----\nbm90LWEta2V5LXRmZGFnLXRlc3Q=\n-----END PRIVATE KEY-----\n"
    key_file = tmp_path / "service-account.json"
    key_file.write_text(json.dumps({
        "type": "service_account", "project_id": "tfdag-test", "private_key_id": "0", "private_key": secret,
        "client_email": "tfdag@tfdag-test.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "http://127.0.0.1:9/token"}))
    return {}, {"token": str(key_file)}, "bm90LWEta2V5LXRmZGFnLXRlc3Q="


def _az_handle(request) -> StoreHandle:
    server = request.getfixturevalue("az_server")
    server.start()
    _clear_fs_caches()
    import adlfs

    fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True)
    _fresh_bucket(fs, BUCKET)
    return StoreHandle(protocol="az", bucket=BUCKET, fs=fs, server=server, secret=emulators.AZURITE_KEY,
                       options={"connection_string": os.environ["AZURE_STORAGE_CONNECTION_STRING"]},
                       credentials_fn=_az_credentials)


def _az_credentials(tmp_path, monkeypatch) -> tuple[dict, dict, str]:
    """Azurite checks each request's SharedKey signature against its development account's key."""
    good = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    wrong_key = "d3Jvbmcta2V5LWZvci10aGUtZGV2LWFjY291bnQtdGZkYWctdGVzdC0xMjM0NTY3OA=="
    return {"connection_string": good}, {"connection_string": good.replace(emulators.AZURITE_KEY, wrong_key)}, wrong_key


_HANDLES = {"s3": _s3_handle, "gs": _gs_handle, "az": _az_handle}


@pytest.fixture(params=sorted(_HANDLES))
def store(request, tmp_path, monkeypatch) -> Iterator[StoreHandle]:
    """Each object store in turn, with an empty `tfdag-demo` bucket and a private tfdag cache dir."""
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "tfdag-cache"))
    handle = _HANDLES[request.param](request)
    yield handle
    if hasattr(handle.server, "request_hook"):
        handle.server.request_hook = None
    handle.start()
    _clear_fs_caches()


@pytest.fixture
def s3(request, tmp_path, monkeypatch) -> Iterator[StoreHandle]:
    """The S3 store alone, for the tests that need moto's own features (IAM users, request hooks)."""
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "tfdag-cache"))
    handle = _s3_handle(request)
    yield handle
    handle.server.request_hook = None
    handle.start()
    _clear_fs_caches()


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
