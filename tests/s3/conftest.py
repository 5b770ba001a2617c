"""A real S3 API for the tests: moto's server mode on a free 127.0.0.1 port, with s3fs pointed at it.

The server runs in this process (moto's backends are in-process state), so a test can stop it (an outage:
connections are refused) and start it again on the same port with every bucket and object still there.
Clients find it through the standard `AWS_ENDPOINT_URL` variable, with dummy credentials.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator

import pytest
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

from pipeline_lib.core.net import free_port

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


def _clear_fs_caches() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(s3_server, tmp_path, monkeypatch):
    """A fresh S3 state with the `tfdag-demo` bucket, a private tfdag cache dir, and an s3fs client."""
    import boto3
    import s3fs

    s3_server.start()
    s3_server.request_hook = None
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{s3_server.endpoint}/moto-api/reset", method="POST"))
    _clear_fs_caches()
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "tfdag-cache"))
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    yield S3Handle(server=s3_server, fs=fs, bucket=BUCKET)
    s3_server.request_hook = None
    s3_server.start()
    _clear_fs_caches()


class S3Handle:
    """What a test gets: the server, an s3fs client and the bucket name."""

    def __init__(self, server: S3Server, fs, bucket: str):
        self.server = server
        self.fs = fs
        self.bucket = bucket

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `s3://<bucket>/<prefix>`, fresh from the server (no listing cache)."""
        self.fs.invalidate_cache()
        root = f"{self.bucket}/{prefix}".rstrip("/")
        if not self.fs.exists(root):
            return []
        return sorted(p.removeprefix(f"{self.bucket}/") for p in self.fs.find(root))


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

