"""A storage outage during conversion: the S3 server stops mid-upload and comes back; the stage retries.

The final dataset must be exactly the manifest's shard set, each matching its sha256, and at no moment may
a manifest describe a partial shard set.
"""

from __future__ import annotations

import threading
import time

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.core import storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import load_manifest
from tasks import stages
from tests.s3.conftest import BUCKET

pytestmark = pytest.mark.slow

ROOT = f"s3://{BUCKET}/outage"
# The S3 client fails fast here (one attempt per request, below), so the conversion attempt in flight
# fails; the outage ends before the stage's last retry (retries=2, 2 s apart) starts.
OUTAGE_S = 3.0
FAIL_AT_SHARD_PUT = 3


def _object_keys() -> set[str]:
    """Keys straight from the server's in-process state (works while the server is stopped)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    return set(s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[BUCKET].keys.keys())


class Outage:
    """Stops the server when the n-th shard upload arrives, restarts it `OUTAGE_S` later."""

    def __init__(self, server, at_put: int):
        self.server = server
        self.at_put = at_put
        self.puts = 0
        self.keys_when_stopped: set[str] | None = None
        self.stopped_at = self.restarted_at = None
        self.done = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, environ) -> None:
        if environ["REQUEST_METHOD"] != "PUT" or ".tfrecord" not in environ.get("PATH_INFO", ""):
            return
        with self._lock:
            self.puts += 1
            if self.puts != self.at_put:
                return
        # Not from this request thread: stopping waits for the request threads to finish.
        threading.Thread(target=self._outage, daemon=True).start()

    def _outage(self) -> None:
        self.server.stop()
        self.stopped_at = time.monotonic()
        self.keys_when_stopped = _object_keys()
        time.sleep(OUTAGE_S)
        self.server.start()
        self.restarted_at = time.monotonic()
        self.done.set()


def _config(tmp_path):
    return parse_config({
        "name": "outage",
        "data": {"source": f"s3://{BUCKET}/raw/digits.csv", "label": "target", "target_shard_mb": 0.02},
        "output_root": ROOT,
        "tracking": {"enabled": False},
    })


def test_conversion_retries_through_an_outage_and_publishes_a_complete_set(s3, tmp_path, prefect_api,
                                                                           monkeypatch):
    # botocore's own retries (up to ~15 s of backoff per request) would otherwise ride out the outage.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    config = _config(tmp_path)
    demo_data.write_digits_csv(config.data.source, config.data.storage_options)
    attempts = []
    failures: list[BaseException] = []

    def counting_convert(*args, **kwargs):
        attempts.append(time.monotonic())
        try:
            return convert(*args, **kwargs)
        except BaseException as error:
            failures.append(error)
            raise

    monkeypatch.setattr(stages, "convert", counting_convert)
    outage = Outage(s3.server, FAIL_AT_SHARD_PUT)
    s3.server.request_hook = outage
    manifest = stages.convert_to_tfrecords(config)
    s3.server.request_hook = None
    assert outage.done.wait(60), "the outage never happened: too few shards for the test"

    # The outage interrupted the shard uploads: no manifest was visible then, only part of the shards.
    prefix = manifest.dataset_uri.removeprefix(f"s3://{BUCKET}/")
    assert f"{prefix}/manifest.json" not in outage.keys_when_stopped
    shards_then = {k for k in outage.keys_when_stopped if k.startswith(prefix) and ".tfrecord" in k}
    assert 0 < len(shards_then) < len(manifest.shards)
    # The stage ran again after the failure (Prefect's task retries), and succeeded.
    assert len(attempts) >= 2
    # Each failed attempt raised an outage (retried), never a ConversionError (bad input: not retried).
    assert failures
    for failure in failures:
        assert is_transient(failure), repr(failure)
        assert not isinstance(failure, ConversionError), repr(failure)
    assert attempts[-1] > outage.stopped_at

    # The final dataset is exactly the manifest's shard set, every shard matching its sha256.
    assert load_manifest(manifest.dataset_uri) == manifest
    keys = set(s3.keys(prefix))
    shard_keys = {k for k in keys if ".tfrecord" in k}
    assert shard_keys == {f"{prefix}/{s.path}" for s in manifest.shards}
    for shard in manifest.shards:
        assert storage.sha256_file(s3.fs, f"{BUCKET}/{prefix}/{shard.path}") == shard.sha256
    assert manifest.num_records("train") + manifest.num_records("eval") == 1797
