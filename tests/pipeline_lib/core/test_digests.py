"""pipeline_lib.core.digests: one hash function per manifest digest algorithm, and manifests from before BLAKE3."""

from __future__ import annotations

import hashlib
import json

import blake3
import fsspec
import pytest

from pipeline_lib.core import digests, download
from pipeline_lib.core.digests import DigestAlgorithm
from pipeline_lib.data.manifest import Manifest
from tests.conftest import write_dataset

_PAYLOAD = bytes(range(256)) * 40_000  # 10 MB: several reads of the streamed digests

_REFERENCE = {DigestAlgorithm.SHA256: hashlib.sha256(_PAYLOAD).hexdigest(),
              DigestAlgorithm.BLAKE3: blake3.blake3(_PAYLOAD).hexdigest()}


@pytest.mark.parametrize("algorithm", list(DigestAlgorithm))
def test_every_algorithm_streams_a_file_to_the_reference_digest(tmp_path, algorithm):
    path = tmp_path / "payload.bin"
    path.write_bytes(_PAYLOAD)
    assert digests.local_file_digest(str(path), algorithm) == _REFERENCE[algorithm]
    assert digests.file_digest(fsspec.filesystem("file"), str(path), algorithm.value) == _REFERENCE[algorithm]
    target = tmp_path / "downloaded.bin"
    assert download.download_verified(fsspec.filesystem("file"), str(path), str(target), _REFERENCE[algorithm],
                                      algorithm) == len(_PAYLOAD)
    other = DigestAlgorithm.SHA256 if algorithm == DigestAlgorithm.BLAKE3 else DigestAlgorithm.BLAKE3
    with pytest.raises(download.ChecksumMismatch, match=algorithm.value):
        download.download_verified(fsspec.filesystem("file"), str(path), str(tmp_path / "x"), _REFERENCE[other],
                                   algorithm)


def test_an_unknown_algorithm_is_refused_naming_it_and_the_fix():
    with pytest.raises(ValueError, match=r"'md5'.*newer tfdag: upgrade it, or convert the data again"):
        digests.new_digest("md5")


def test_a_manifest_written_before_the_algorithm_was_recorded_loads_as_sha256(tmp_path):
    manifest = write_dataset(str(tmp_path / "data"), num_train=8, num_eval=4)
    old = json.loads(manifest.to_json())
    for shard in old["shards"]:  # as manifests were written before: the digest under "sha256", no algorithm
        shard["sha256"] = shard.pop("digest")
    old.pop("shard_digest")
    loaded = Manifest.model_validate_json(json.dumps(old))
    assert loaded.shard_digest == DigestAlgorithm.SHA256
    assert loaded.content_hash() == manifest.content_hash()
    for shard in loaded.shards:
        assert digests.local_file_digest(str(tmp_path / "data" / shard.path), loaded.shard_digest) == shard.digest
