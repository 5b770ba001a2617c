"""Tests for pipeline_lib.training.input_pipeline: batched parsing, sharding, shuffling, gzip, skipping."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.training import input_pipeline
from tests.conftest import generate_rows, write_dataset


def _collect(dataset):
    numeric, colors, labels = [], [], []
    for inputs, y in dataset:
        numeric.append(inputs["numeric"].numpy())
        colors.append(inputs["color"].numpy())
        labels.append(y.numpy())
    return np.concatenate(numeric), np.concatenate(colors), np.concatenate(labels)


def test_batched_parse_gives_the_rows_back(tiny_manifest):
    rows = generate_rows(256, 0)
    dataset = input_pipeline.create_dataset(tiny_manifest, "train", 50)
    numeric, colors, labels = _collect(dataset)
    assert numeric.shape == (256, 5) and numeric.dtype == np.float32
    expected = np.array([np.concatenate([r["x"], [r["size"]]]) for r in rows], dtype=np.float32)
    np.testing.assert_allclose(numeric, expected)
    assert [c[0].decode() for c in colors] == [r["color"] for r in rows]
    assert labels.dtype == np.int64
    assert labels.tolist() == [r["label"] for r in rows]


def test_drop_remainder_gives_static_batch_shapes(tiny_manifest):
    dataset = input_pipeline.create_dataset(tiny_manifest, "train", 32, drop_remainder=True)
    inputs, labels = dataset.element_spec
    assert inputs["numeric"].shape.as_list() == [32, 5]
    assert labels.shape.as_list() == [32]
    # The parse map sees a vector of serialized Examples, not one string at a time.
    assert input_pipeline.input_signature(tiny_manifest.feature_schema)["numeric"].shape.as_list() == [None, 5]


def test_data_shards_partition_the_records(tiny_manifest):
    _, _, everything = _collect(input_pipeline.create_dataset(tiny_manifest, "train", 64))
    halves = [_collect(input_pipeline.create_dataset(tiny_manifest, "train", 64, shard=(2, i)))[2] for i in range(2)]
    assert halves[0].tolist() == everything[0::2].tolist()
    assert halves[1].tolist() == everything[1::2].tolist()
    assert input_pipeline.num_shard_records(tiny_manifest, "train", None, (2, 1)) == 128


def test_shuffle_is_seeded_and_skip_resumes(tiny_manifest):
    def labels(seed, skip=0):
        dataset = input_pipeline.create_dataset(tiny_manifest, "train", 16, shuffle=True, seed=seed,
                                                shuffle_buffer=256, skip_batches=skip)
        return _collect(dataset)[0]

    first, again, other = labels(1), labels(1), labels(2)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    np.testing.assert_array_equal(labels(1, skip=3), first[48:])


def test_gzip_and_file_subset(tmp_path):
    manifest = write_dataset(str(tmp_path / "gz"), num_train=90, num_train_shards=3, compression="gzip")
    files = [s.path for s in manifest.shards_for("train")]
    assert all(f.endswith(".tfrecord.gz") for f in files)
    _, _, labels = _collect(input_pipeline.create_dataset(manifest, "train", 64, files=files[1:2]))
    assert len(labels) == 30
    with pytest.raises(ValueError, match="not 'train' shards"):
        input_pipeline.create_dataset(manifest, "train", 8, files=["train/nope.tfrecord"])


def test_regression_labels_are_float(tmp_path):
    manifest = write_dataset(str(tmp_path / "reg"), num_train=40, task="regression")
    _, labels = next(iter(input_pipeline.create_dataset(manifest, "train", 8)))
    assert labels.dtype == tf.float32


def test_repeat_continues_past_one_epoch(tiny_manifest):
    dataset = input_pipeline.create_dataset(tiny_manifest, "eval", 48, repeat=True, drop_remainder=True)
    assert len(list(dataset.take(5))) == 5


def test_bad_arguments_name_the_value(tiny_manifest):
    with pytest.raises(ValueError, match=r"batch_size \(0\)"):
        input_pipeline.create_dataset(tiny_manifest, "train", 0)
    with pytest.raises(ValueError, match="shard"):
        input_pipeline.create_dataset(tiny_manifest, "train", 8, shard=(2, 2))
    with pytest.raises(ValueError, match="'test' has no shards"):
        input_pipeline.create_dataset(tiny_manifest, "test", 8)


def _reference(manifest, batch_size, *, shuffle=False, seed=0, shuffle_buffer=256, shard=None, repeat=False,
               drop_remainder=False, skip_batches=0):
    """The plain recipe: batch the record stream to batch_size, then parse each batch."""
    dataset = tf.data.TFRecordDataset(input_pipeline.shard_uris(manifest, "train"))
    if shard is not None:
        dataset = dataset.shard(*shard)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder).skip(skip_batches)
    return dataset.map(input_pipeline.make_parse_fn(manifest.feature_schema))


def _batches(dataset, limit=None):
    dataset = dataset.take(limit) if limit is not None else dataset
    return [(inputs["numeric"].numpy(), inputs["color"].numpy(), labels.numpy()) for inputs, labels in dataset]


@pytest.mark.parametrize("batch_size,parse_rows,options", [
    (16, 40, {}),  # parse batches of 48 records cut into 3 batches of 16
    (24, 40, {"drop_remainder": True}),  # 48-record parse batches; 256 records end in a partial batch
    (7, 20, {"shuffle": True, "seed": 3, "skip_batches": 5}),  # batches span parse-batch boundaries
    (10, 64, {"shard": (2, 1), "drop_remainder": True}),
    (12, 30, {"shuffle": True, "seed": 1, "repeat": True, "drop_remainder": True, "skip_batches": 30}),
    (300, 1024, {}),  # batch larger than the data: one partial batch
])
def test_parse_batching_gives_the_batches_of_the_plain_recipe(tiny_manifest, monkeypatch, batch_size, parse_rows,
                                                               options):
    monkeypatch.setattr(input_pipeline, "PARSE_BATCH_ROWS", parse_rows)
    assert input_pipeline.parse_batch_size(batch_size) % batch_size == 0
    assert input_pipeline.parse_batch_size(batch_size) >= min(parse_rows, batch_size)
    limit = 60 if options.get("repeat") else None
    got = _batches(input_pipeline.create_dataset(tiny_manifest, "train", batch_size, shuffle_buffer=256, **options),
                   limit)
    expected = _batches(_reference(tiny_manifest, batch_size, **options), limit)
    assert len(got) == len(expected) > 0
    for (numeric, colors, labels), (numeric_ref, colors_ref, labels_ref) in zip(got, expected):
        np.testing.assert_array_equal(numeric, numeric_ref)
        np.testing.assert_array_equal(colors, colors_ref)
        np.testing.assert_array_equal(labels, labels_ref)


def test_parse_batch_size_is_a_multiple_of_the_batch():
    rows = input_pipeline.PARSE_BATCH_ROWS
    assert input_pipeline.parse_batch_size(32) == max(32, rows) and rows % 32 == 0
    assert input_pipeline.parse_batch_size(300) == 300 * -(-rows // 300)
    assert input_pipeline.parse_batch_size(4 * rows) == 4 * rows


def _converted(tmp_path, name: str, *, ints: bool, task: str = "classification", num_rows: int = 600):
    """A numeric dataset written by conversion (so its manifest records the byte layout) from a NumPy .npz."""
    from pipeline_lib.config import DataConfig
    from pipeline_lib.data.convert import convert

    rng = np.random.default_rng(7)
    arrays = {"x": rng.normal(size=(num_rows, 4)).astype(np.float32), "f": rng.normal(size=num_rows).astype(np.float32)}
    if ints:
        arrays["size"] = rng.integers(0, 5, size=num_rows)  # one-byte varints
        arrays["big"] = rng.integers(1 << 14, 1 << 21, size=num_rows)  # three-byte varints
    arrays["label"] = (rng.integers(0, 3, size=num_rows) if task == "classification"
                       else rng.normal(size=num_rows).astype(np.float32))
    source = tmp_path / f"{name}.npz"
    np.savez(source, **arrays)
    return convert(DataConfig(source=str(source), label="label", read_chunk_rows=128), str(tmp_path / name))


def _numeric_batches(dataset):
    return [(inputs["numeric"].numpy(), labels.numpy()) for inputs, labels in dataset]


@pytest.mark.parametrize("ints,task", [(False, "classification"), (True, "classification"), (True, "regression")])
@pytest.mark.parametrize("batch_size,options", [
    (32, {}),
    (7, {"shuffle": True, "seed": 3, "skip_batches": 5, "drop_remainder": True}),
    (10, {"shard": (2, 1)}),
])
def test_the_record_layout_gives_the_batches_parsing_gives(tmp_path, ints, task, batch_size, options):
    manifest = _converted(tmp_path, "data", ints=ints, task=task)
    assert manifest.record_layout is not None
    parsed = manifest.model_copy(update={"record_layout": None})
    assert input_pipeline.make_layout_inputs_fn(parsed.feature_schema, parsed.record_layout) is None
    got = _numeric_batches(input_pipeline.create_dataset(manifest, "train", batch_size, shuffle_buffer=64, **options))
    expected = _numeric_batches(input_pipeline.create_dataset(parsed, "train", batch_size, shuffle_buffer=64,
                                                              **options))
    assert len(got) == len(expected) > 0
    for (numeric, labels), (numeric_ref, labels_ref) in zip(got, expected):
        assert numeric.dtype == numeric_ref.dtype and labels.dtype == labels_ref.dtype
        np.testing.assert_array_equal(numeric, numeric_ref)
        np.testing.assert_array_equal(labels, labels_ref)


def test_layout_parse_equals_parse_example_for_every_feature(tmp_path):
    manifest = _converted(tmp_path, "data", ints=True)
    schema = manifest.feature_schema
    records = next(iter(tf.data.TFRecordDataset(input_pipeline.shard_uris(manifest, "train")).batch(1000)))
    got = input_pipeline.make_layout_parse_fn(schema, manifest.record_layout)(records)
    expected = tf.io.parse_example(records, input_pipeline.feature_description(schema))
    assert set(got) == set(expected) == {"x", "f", "size", "big", "label"}
    for name, values in expected.items():
        assert got[name].dtype == values.dtype and got[name].shape == values.shape, name
        np.testing.assert_array_equal(got[name].numpy(), values.numpy())


def test_records_that_do_not_have_the_layout_fail_with_the_fix(tmp_path):
    manifest = _converted(tmp_path, "data", ints=False)
    layout = manifest.record_layout
    wrong = manifest.model_copy(update={"record_layout": layout.model_copy(update={"record_bytes": layout.record_bytes + 1})})
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"not {layout.record_bytes + 1} bytes long.*convert the source again"):
        next(iter(input_pipeline.create_dataset(wrong, "train", 8)))


def test_a_layout_that_does_not_fit_the_schema_is_not_used(tmp_path):
    manifest = _converted(tmp_path, "data", ints=True)
    schema, layout = manifest.feature_schema, manifest.record_layout
    fields = {f.name: f for f in layout.fields}
    renamed = layout.model_copy(update={"fields": tuple(f.model_copy(update={"name": f.name + "_"}) for f in layout.fields)})
    as_float = layout.model_copy(update={"fields": tuple(
        f.model_copy(update={"varint_bytes": 0}) if f.name == "size" else f for f in layout.fields)})
    shorter = layout.model_copy(update={"fields": tuple(
        f.model_copy(update={"count": 3}) if f.name == "x" else f for f in layout.fields)})
    assert fields["size"].varint_bytes == 1 and fields["big"].varint_bytes == 3
    for bad in (renamed, as_float, shorter):
        assert input_pipeline.make_layout_parse_fn(schema, bad) is None
    assert input_pipeline.make_layout_parse_fn(schema, layout) is not None
