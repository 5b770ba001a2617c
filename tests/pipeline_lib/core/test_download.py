"""Tests for pipeline_lib.core.download: an object lands under its name only when its sha256 matches."""

from __future__ import annotations

import hashlib
import os
import uuid

import fsspec
import pytest

from pipeline_lib.core import download


@pytest.fixture
def remote():
    fs = fsspec.filesystem("memory")
    path = f"/tfdag-dl-{uuid.uuid4().hex[:8]}/object.bin"
    fs.pipe_file(path, b"payload" * 1000)
    yield fs, path
    fs.rm(os.path.dirname(path), recursive=True)


def test_a_matching_object_is_renamed_into_place(remote, tmp_path):
    fs, path = remote
    target = tmp_path / "object.bin"
    size = download.download_verified(fs, path, str(target), hashlib.sha256(b"payload" * 1000).hexdigest())
    assert size == 7000 and target.read_bytes() == b"payload" * 1000
    assert os.listdir(tmp_path) == ["object.bin"]


def test_a_mismatch_leaves_nothing_behind(remote, tmp_path):
    fs, path = remote
    with pytest.raises(download.ChecksumMismatch) as caught:
        download.download_verified(fs, path, str(tmp_path / "object.bin"), "0" * 64)
    assert caught.value.num_bytes == 7000
    assert caught.value.digest == hashlib.sha256(b"payload" * 1000).hexdigest()
    assert os.listdir(tmp_path) == []
