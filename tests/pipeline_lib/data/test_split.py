"""The deterministic split: independent of chunking and row order, by key columns, by seed."""

from __future__ import annotations

import os
import random

import numpy as np

from pipeline_lib.config import DataConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.split import eval_mask, split_hash
from tests.pipeline_lib.data.conversion_support import (
    make_rows,
    split_of_ids,
    write_csv,
)


def test_split_is_deterministic_across_chunk_sizes_and_row_order(tmp_path):
    rows = make_rows(600, seed=1)
    first = write_csv(tmp_path / "ordered.csv", rows)
    shuffled = rows[:]
    random.Random(9).shuffle(shuffled)
    second = write_csv(tmp_path / "shuffled.csv", shuffled)
    splits = []
    for source, chunk in ((first, 65536), (first, 7), (second, 50)):
        out = tmp_path / f"out-{chunk}-{os.path.basename(source)}"
        manifest = convert(DataConfig(source=source, label="y", read_chunk_rows=chunk), str(out))
        splits.append(split_of_ids(manifest))
    assert splits[0] == splits[1] == splits[2]
    num_eval = sum(1 for s in splits[0].values() if s == "eval")
    assert 0.12 < num_eval / 600 < 0.28  # eval_fraction 0.2


def test_split_by_key_columns_keeps_keys_together(tmp_path):
    rows = make_rows(300, seed=2)
    for row in rows:
        row["user"] = row["id"] % 30
    source = write_csv(tmp_path / "a.csv", rows, header=("id", "user", "x", "n", "color", "y"))
    data = DataConfig(source=source, label="y", split={"key_columns": ["user"], "eval_fraction": 0.3, "seed": 4})
    manifest = convert(data, str(tmp_path / "out"))
    by_id = split_of_ids(manifest)
    per_user: dict[int, set] = {}
    for row in rows:
        per_user.setdefault(row["user"], set()).add(by_id[row["id"]])
    assert all(len(s) == 1 for s in per_user.values())
    assert {next(iter(s)) for s in per_user.values()} == {"train", "eval"}


def test_split_seed_changes_the_split():
    columns = {"a": np.arange(1000, dtype=np.int64)}
    one = eval_mask(split_hash(columns, 0), 0.5)
    two = eval_mask(split_hash(columns, 1), 0.5)
    assert (one != two).any()
    np.testing.assert_array_equal(one, eval_mask(split_hash(columns, 0), 0.5))
    # Hash of a row does not depend on the other rows of the chunk.
    np.testing.assert_array_equal(split_hash({"a": columns["a"][500:]}, 0),
                                  split_hash(columns, 0)[500:])
