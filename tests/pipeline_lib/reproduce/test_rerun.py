"""The rerun's check of recorded shards (pipeline_lib.reproduce.rerun): each verified by its manifest's algorithm."""

from __future__ import annotations

import os

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.reproduce import rerun
from tests.conftest import write_dataset
from tests.pipeline_lib.data.conversion_support import make_rows, write_csv


def test_converted_blake3_shards_verify_and_a_changed_byte_is_named(tmp_path):
    write_csv(tmp_path / "raw.csv", make_rows(400, seed=1))
    manifest = convert(DataConfig(source=str(tmp_path / "raw.csv"), label="y"), str(tmp_path / "out"))
    assert manifest.shard_digest == "blake3"
    assert rerun._shard_problems(manifest, {}) == []
    shard = manifest.shards_for("train")[0]
    path = os.path.join(manifest.dataset_uri.removeprefix("file://"), shard.path)
    with open(path, "r+b") as handle:
        handle.seek(20)
        handle.write(b"\x00\xff")
    (problem,) = rerun._shard_problems(manifest, {})
    assert shard.path in problem and "has blake3" in problem and shard.digest[:12] in problem


def test_a_sha256_manifest_still_verifies(tmp_path):
    manifest = write_dataset(str(tmp_path / "data"), num_train=16, num_eval=4)
    assert manifest.shard_digest == "sha256"
    assert rerun._shard_problems(manifest, {}) == []
