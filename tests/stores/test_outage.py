"""A storage outage during conversion, on every object store: the server stops while the shards are uploaded and
comes back; the upload is retried (by the store's client or by the stage's task retries) and the result is whole.

The final dataset must be exactly the manifest's shard set, each matching its digest, and at no moment may a
manifest describe a partial shard set.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fsspec.asyn import sync_wrapper

from pipeline_lib.config import parse_config
from pipeline_lib.core import digests, storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.manifest import load_manifest
from tasks import stages
from tests.stores.conftest import _clear_fs_caches

pytestmark = pytest.mark.slow

# gcsfs and the Azure SDK retry a refused connection themselves, with backoff, for longer than this: the server comes
# back after OUTAGE_S while their upload waits. s3fs fails fast here (one attempt per request, below): the server comes
# back as soon as the attempt in flight has failed, so the stage's retry (whenever the load lets it start) finds it up.
OUTAGE_S = 3.0
FAIL_AT_SHARD_PUT = 3


class Outage:
    """Stops the store's server just before the n-th shard upload leaves the client, restarts it `OUTAGE_S` later."""

    def __init__(self, store, at_put: int, prefix: str):
        self.store = store
        self.at_put = at_put
        self.prefix = prefix
        self.puts = 0
        self.keys_when_stopped: list[str] | None = None
        self.stopped_at = self.restarted_at = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._restart = threading.Lock()

    def hook(self, original):
        outage = self

        async def put_file(fs, lpath, rpath, *args, **kwargs):
            if ".tfrecord" in str(rpath):
                with outage._lock:
                    outage.puts += 1
                    now = outage.puts == outage.at_put
                if now:  # off the client's event loop: listing the store needs that loop
                    await asyncio.get_running_loop().run_in_executor(None, outage.begin)
            return await original(fs, lpath, rpath, *args, **kwargs)

        return put_file

    def begin(self) -> None:
        self.keys_when_stopped = self.store.keys(self.prefix)
        self.store.stop()
        self.stopped_at = time.monotonic()
        threading.Thread(target=self._end, daemon=True).start()

    def _end(self) -> None:
        time.sleep(OUTAGE_S)
        self.end()

    def end(self) -> None:
        """Restarts the server (once; a second call waits for the first)."""
        with self._restart:
            if self.done.is_set() or self.stopped_at is None:
                return
            self.store.start()
            self.restarted_at = time.monotonic()
            self.done.set()


def test_conversion_retries_through_an_outage_and_publishes_a_complete_set(store, prefect_api, monkeypatch):
    # botocore's own retries (up to ~15 s of backoff per request) would otherwise ride out the outage.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    config = parse_config({
        "name": "outage",
        "data": {"source": store.uri("raw/digits.csv"), "label": "target", "target_shard_mb": 0.02},
        "output_root": store.uri("outage"),
        "tracking": {"enabled": False},
    })
    demo_data.write_digits_csv(config.data.source, config.data.storage_options)
    attempts = []
    failures: list[BaseException] = []

    def counting_convert(*args, **kwargs):
        attempts.append(time.monotonic())
        try:
            return convert(*args, **kwargs)
        except BaseException as error:
            failures.append(error)
            if not store.client_rides_out_outages:
                outage.end()
            raise

    monkeypatch.setattr(stages, "convert", counting_convert)
    outage = Outage(store, FAIL_AT_SHARD_PUT, "outage/data")
    fs_class = type(storage.get_fs(config.output_root)[0])
    hooked = outage.hook(fs_class._put_file)
    monkeypatch.setattr(fs_class, "_put_file", hooked)
    # Some clients bind put_file to _put_file when the class or an instance is made: hook it, forget the instances.
    monkeypatch.setattr(fs_class, "put_file", sync_wrapper(hooked))
    _clear_fs_caches()
    manifest = stages.convert_to_tfrecords(config)
    assert outage.done.wait(60), "the outage never happened: too few shards for the test"

    # The outage interrupted the shard uploads: no manifest was visible then, only part of the shards.
    prefix = manifest.dataset_uri.removeprefix(f"{store.uri()}/")
    assert f"{prefix}/manifest.json" not in outage.keys_when_stopped
    shards_then = {k for k in outage.keys_when_stopped if k.startswith(prefix) and ".tfrecord" in k}
    assert 0 < len(shards_then) < len(manifest.shards)
    # Each failed attempt raised an outage (retried), never a ConversionError (bad input: not retried).
    for failure in failures:
        assert is_transient(failure), repr(failure)
        assert not isinstance(failure, ConversionError), repr(failure)
    if store.client_rides_out_outages:
        # The client retried the refused upload until the server was back, inside the one attempt.
        assert len(attempts) + len(failures) >= 1
    else:
        # The stage ran again after the failure (Prefect's task retries), and succeeded.
        assert len(attempts) >= 2 and failures
        assert attempts[-1] > outage.stopped_at

    # The final dataset is exactly the manifest's shard set, every shard matching its digest.
    assert load_manifest(manifest.dataset_uri) == manifest
    keys = set(store.keys(prefix))
    shard_keys = {k for k in keys if ".tfrecord" in k}
    assert shard_keys == {f"{prefix}/{s.path}" for s in manifest.shards}
    for shard in manifest.shards:
        assert digests.file_digest(store.fs, f"{store.bucket}/{prefix}/{shard.path}",
                                   manifest.shard_digest) == shard.digest
    assert manifest.num_records("train") + manifest.num_records("eval") == 1797
