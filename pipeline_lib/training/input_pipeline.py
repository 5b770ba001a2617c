"""tf.data input pipelines over the manifest's TFRecord shards: batch first, then a batched, fused Example parse."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import tensorflow as tf

from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    RecordLayout,
    Schema,
)
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.training.column_names import NUMERIC_KEY, input_names

logger = logging.getLogger(__name__)

# parse_example costs a fixed amount per call on top of its per-record work; at the trainer's batch sizes
# (32, 256) that fixed part dominates, so records are parsed in batches of at least this many and then
# re-cut to the caller's batch size (`Dataset.rebatch`, which equals unbatch().batch() in one copy).
PARSE_BATCH_ROWS = 1024
# The reader's buffer: larger than TensorFlow's 256 KiB default, so sequential and remote reads make
# fewer, larger requests; one file is open at a time, so this is the whole cost in memory.
READ_BUFFER_BYTES = 4 << 20


def _size(spec: FeatureSpec) -> int:
    size = 1
    for dim in spec.shape:
        size *= int(dim)
    return size


def numeric_features(schema: Schema) -> tuple[FeatureSpec, ...]:
    """The int64 and float32 features but dates and timestamps, in schema order: what `"numeric"` concatenates."""
    return tuple(f for f in schema.features if f.dtype != DType.STRING and f.time is None)


def time_features(schema: Schema) -> tuple[FeatureSpec, ...]:
    """The date and timestamp features, in schema order: one int64 model input each (the instant; the model
    derives its calendar parts), never float32 in `"numeric"`, where microseconds would round to minutes."""
    return tuple(f for f in schema.features if f.time is not None)


def string_features(schema: Schema) -> tuple[FeatureSpec, ...]:
    """The string features, in schema order: one model input each."""
    return tuple(f for f in schema.features if f.dtype == DType.STRING)


def numeric_columns(schema: Schema) -> dict[str, slice]:
    """Where each numeric feature sits in the `"numeric"` input: name → its columns."""
    columns, start = {}, 0
    for spec in numeric_features(schema):
        columns[spec.name] = slice(start, start + _size(spec))
        start += _size(spec)
    return columns


def feature_width(schema: Schema) -> int:
    """Width of the `"numeric"` input: every numeric feature flattened and concatenated."""
    return sum(_size(f) for f in numeric_features(schema))


def input_signature(schema: Schema) -> dict[str, tf.TensorSpec]:
    """The batched model inputs `create_dataset` yields, as TensorSpecs (batch dimension None)."""
    signature: dict[str, tf.TensorSpec] = {}
    if numeric_features(schema):
        signature[NUMERIC_KEY] = tf.TensorSpec([None, feature_width(schema)], tf.float32, name=NUMERIC_KEY)
    names = input_names(schema)  # the dict's keys, and the tensors' (and Keras inputs') names
    for spec in string_features(schema):
        signature[names[spec.name]] = tf.TensorSpec([None, _size(spec)], tf.string, name=names[spec.name])
    for spec in time_features(schema):
        signature[names[spec.name]] = tf.TensorSpec([None, 1], tf.int64, name=names[spec.name])
    return signature


def _tf_dtype(dtype: DType) -> tf.DType:
    return {DType.INT64: tf.int64, DType.FLOAT32: tf.float32, DType.STRING: tf.string}[dtype]


def feature_description(schema: Schema) -> dict[str, tf.io.FixedLenFeature]:
    """The `tf.io.parse_example` spec for every feature and the label."""
    description = {
        spec.name: tf.io.FixedLenFeature(list(spec.shape), _tf_dtype(spec.dtype)) for spec in schema.features
    }
    label = schema.label
    description[label.name] = tf.io.FixedLenFeature(list(label.shape), _tf_dtype(label.dtype))
    return description


def label_dtype(schema: Schema, is_classification: bool | None = None) -> tf.DType:
    """int64 for classification labels, float32 for regression ones."""
    if is_classification is None:
        is_classification = schema.num_classes is not None or schema.label_vocabulary is not None
    return tf.int64 if is_classification else tf.float32


def make_parse_fn(schema: Schema, is_classification: bool | None = None):
    """A function from a batch of serialized Examples to `(inputs, labels)`."""
    description = feature_description(schema)
    to_inputs = make_inputs_fn(schema, is_classification)

    def parse(serialized: tf.Tensor):
        return to_inputs(tf.io.parse_example(serialized, description))

    return parse


def _layout_fields(schema: Schema, layout: RecordLayout | None):
    """{name: (FieldLayout, FeatureSpec)} for every feature and the label, when `layout` can stand in for parsing
    `schema` (numbers only, names and value counts alike, a little-endian host); else None."""
    if layout is None or sys.byteorder != "little":
        return None
    fields = {f.name: f for f in layout.fields}
    specs = {spec.name: spec for spec in (*schema.features, schema.label)}
    if set(fields) != set(specs):
        return None
    for name, spec in specs.items():
        field = fields[name]
        if spec.dtype == DType.STRING or field.count != _size(spec) or field.varint_bytes > 9:
            return None
        if (spec.dtype == DType.FLOAT32) != (field.varint_bytes == 0):
            return None
    return {name: (fields[name], spec) for name, spec in specs.items()}


def _record_matrix(serialized: tf.Tensor, record_bytes: int) -> tf.Tensor:
    """A batch of records as a [batch, record_bytes] uint8 matrix, after checking every record has that length."""
    check = tf.debugging.assert_equal(
        tf.strings.length(serialized), record_bytes,
        message=f"a record is not {record_bytes} bytes long, the layout the dataset's manifest records; the "
                "shards changed after conversion: convert the source again")
    with tf.control_dependencies([check]):
        return tf.io.decode_raw(serialized, tf.uint8, fixed_length=record_bytes)


def _field_values(matrix: tf.Tensor, field, spec: FeatureSpec) -> tf.Tensor:
    """One feature's values out of the record matrix, shaped as parse_example gives them."""
    if field.varint_bytes == 0:  # little-endian float32s
        piece = matrix[:, field.offset : field.offset + 4 * field.count]
        values = tf.bitcast(tf.reshape(piece, [-1, field.count, 4]), tf.float32)
    else:  # varints of one length: the sum of their 7-bit groups
        width = field.varint_bytes
        piece = matrix[:, field.offset : field.offset + width * field.count]
        groups = tf.cast(tf.reshape(piece, [-1, field.count, width]), tf.int64)
        if width == 1:  # a one-byte varint is the value itself
            values = groups[:, :, 0]
        else:
            shifts = tf.constant([7 * i for i in range(width)], tf.int64)
            values = tf.reduce_sum(tf.bitwise.left_shift(tf.bitwise.bitwise_and(groups, 0x7F), shifts), -1)
    return tf.reshape(values, [-1, *spec.shape])


def _layout_parse(fields, record_bytes: int):
    def parse(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
        matrix = _record_matrix(serialized, record_bytes)
        return {name: _field_values(matrix, field, spec) for name, (field, spec) in fields.items()}

    return parse


def make_layout_parse_fn(schema: Schema, layout: RecordLayout | None):
    """Like `tf.io.parse_example` with `feature_description(schema)`, for records of one fixed byte layout.

    Conversion records the layout in the manifest when every record it wrote has it (numbers only, each int64
    column's varints one length). Then each batch of records is checked to be exactly `record_bytes` long,
    viewed as a [batch, record_bytes] uint8 matrix and every feature sliced out at its offset: floats by a
    bitcast of their little-endian bytes, int64 by summing the 7-bit groups of their fixed-length varints.
    Returns None, so the caller parses, when there is no layout, it does not match the schema, or the host
    is not little-endian.
    """
    fields = _layout_fields(schema, layout)
    return None if fields is None else _layout_parse(fields, layout.record_bytes)


def make_layout_inputs_fn(schema: Schema, layout: RecordLayout | None, is_classification: bool | None = None):
    """`make_inputs_fn` applied to `make_layout_parse_fn`, from serialized records to `(inputs, labels)`, or None.

    When every numeric feature is float32 (the common case), the `"numeric"` matrix is one gather of their
    bytes and one bitcast, instead of a slice per feature and a stack: protobuf parsing, which this replaces,
    was about half the CPU of the input pipeline on 33 scalar features.
    """
    fields = _layout_fields(schema, layout)
    if fields is None:
        return None
    numeric = numeric_features(schema)
    if not numeric or time_features(schema) or any(spec.dtype != DType.FLOAT32 for spec in numeric):
        parse, to_inputs = _layout_parse(fields, layout.record_bytes), make_inputs_fn(schema, is_classification)
        return lambda serialized: to_inputs(parse(serialized))
    placed = [fields[spec.name][0] for spec in numeric]
    byte_index = tf.constant([f.offset + i for f in placed for i in range(4 * f.count)], tf.int32)
    width = sum(f.count for f in placed)
    label_field, label_spec = fields[schema.label.name]
    target_dtype = label_dtype(schema, is_classification)

    def inputs(serialized: tf.Tensor):
        matrix = _record_matrix(serialized, layout.record_bytes)
        values = tf.bitcast(tf.reshape(tf.gather(matrix, byte_index, axis=1), [-1, width, 4]), tf.float32)
        labels = tf.cast(tf.reshape(_field_values(matrix, label_field, label_spec), [-1]), target_dtype)
        return {NUMERIC_KEY: values}, labels

    return inputs


def make_inputs_fn(schema: Schema, is_classification: bool | None = None):
    """A function from the dict `tf.io.parse_example` returns (a batch) to `(inputs, labels)`."""
    numeric = numeric_features(schema)
    strings = string_features(schema)
    times = time_features(schema)
    all_scalar = all(not spec.shape for spec in numeric)
    label = schema.label
    target_dtype = label_dtype(schema, is_classification)
    table = None
    if label.dtype == DType.STRING:
        if not schema.label_vocabulary:
            raise ValueError(
                f"label {label.name!r} is a string feature but the schema has no label_vocabulary; "
                "reconvert the data so string labels carry their vocabulary"
            )
        vocabulary = list(schema.label_vocabulary)
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(vocabulary), tf.range(len(vocabulary), dtype=tf.int64)
            ),
            default_value=-1,
        )

    keys = input_names(schema)

    def to_inputs(parsed: dict[str, tf.Tensor]):
        inputs: dict[str, tf.Tensor] = {}
        if numeric:
            values = [parsed[spec.name] if spec.dtype == DType.FLOAT32 else _int_as_float(parsed[spec.name])
                      for spec in numeric]
            if all_scalar:  # one op for the common tabular case instead of a reshape per column and a concat
                inputs[NUMERIC_KEY] = tf.stack(values, axis=1)
            else:
                columns = [tf.reshape(value, [-1, _size(spec)]) for spec, value in zip(numeric, values)]
                inputs[NUMERIC_KEY] = tf.concat(columns, axis=1) if len(columns) > 1 else columns[0]
        for spec in strings:
            inputs[keys[spec.name]] = tf.reshape(parsed[spec.name], [-1, _size(spec)])
        for spec in times:
            inputs[keys[spec.name]] = tf.reshape(parsed[spec.name], [-1, 1])
        labels = parsed[label.name]
        if table is not None:
            labels = table.lookup(labels)
        labels = tf.cast(tf.reshape(labels, [-1]), target_dtype)
        return inputs, labels

    return to_inputs


def _int_as_float(values: tf.Tensor) -> tf.Tensor:
    """int64 values as float32, a missing one (MISSING_INT64, written by conversion) as NaN, like a float's."""
    return tf.where(values == MISSING_INT64, tf.constant(float("nan"), tf.float32), tf.cast(values, tf.float32))


def shard_uris(manifest: Manifest, split: str, files: Sequence[str] | None = None) -> list[str]:
    """Full URIs of the given manifest-relative shard paths (default: every shard of the split).

    Raises:
        ValueError: when the split has no shards or a path is not in the manifest.
    """
    known = {s.path: s for s in manifest.shards_for(split)}
    if files is None:
        if not known:
            splits = sorted({s.split for s in manifest.shards})
            raise ValueError(
                f"split {split!r} has no shards in the manifest of {manifest.dataset_uri}; splits present: {splits}"
            )
        paths = [s.path for s in manifest.shards_for(split)]
    else:
        unknown = [f for f in files if f not in known]
        if unknown:
            raise ValueError(
                f"files {unknown} are not {split!r} shards of the manifest of {manifest.dataset_uri}; "
                "pass paths relative to the dataset directory as listed in manifest.json"
            )
        paths = list(files)
    return [manifest.shard_uri(known[p]) for p in paths]


def parse_batch_size(batch_size: int) -> int:
    """Records per `parse_example` call for a `batch_size` pipeline: a multiple of it, ≥ PARSE_BATCH_ROWS."""
    return batch_size * max(1, -(-PARSE_BATCH_ROWS // batch_size))


def create_dataset(
    manifest: Manifest,
    split: str,
    batch_size: int,
    *,
    files: Sequence[str] | None = None,
    shuffle: bool = False,
    seed: int | tf.Tensor = 0,
    shuffle_buffer: int = 10000,
    shard: tuple[int, int] | None = None,
    repeat: bool = False,
    drop_remainder: bool = False,
    skip_batches: int | tf.Tensor = 0,
    is_classification: bool | None = None,
) -> tf.data.Dataset:
    """Read a split's TFRecord shards into batches of `(inputs, labels)`.

    Records are read in file order, sharded (`shard`), shuffled, parsed in batches of
    `parse_batch_size(batch_size)` records (parallel, order-preserving), re-cut to `batch_size`
    and prefetched. The batches are exactly those of `unbatch().batch(batch_size)` over the record stream,
    so the parse batch size never changes what a step sees. With a fixed `seed` the order is the same on
    every run. Parsing takes the values at the byte offsets of the manifest's `record_layout` when it has one
    (`make_layout_inputs_fn`), and otherwise runs the fused ParseExampleDataset op; both give the same tensors.

    Args:
        manifest: the dataset manifest.
        split: "train" or "eval".
        batch_size: records per batch.
        files: manifest-relative shard paths to read; default every shard of the split.
        shuffle: shuffle records with a `shuffle_buffer`-record buffer seeded by `seed`.
        seed: the shuffle seed (an int, or an int64 scalar tensor where the dataset is built in a traced function).
        shuffle_buffer: records held by the shuffle buffer.
        shard: `(num_shards, index)`: keep every num_shards-th record starting at index (DATA autosharding).
        repeat: repeat forever (each pass reshuffled, deterministically from `seed`).
        drop_remainder: drop a last, smaller batch.
        skip_batches: batches to skip at the start (resuming within an epoch); an int or an int64 scalar tensor.
        is_classification: the label type; default inferred from the schema (num_classes or vocabulary set).

    Returns:
        A dataset of `(inputs, labels)`: `inputs["numeric"]` float32 `[batch, feature_width]`, one tf.string
        `[batch, n]` entry per string feature, one int64 `[batch, 1]` entry (the instant) per date or timestamp; labels int64 (classification) or float32 (regression) `[batch]`.

    Raises:
        ValueError: on a bad batch size, shard or file list.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be ≥ 1")
    if shard is not None:
        num_shards, index = shard
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard {shard} must be (num_shards ≥ 1, 0 ≤ index < num_shards)")
    if isinstance(skip_batches, int) and skip_batches < 0:
        raise ValueError(f"skip_batches ({skip_batches}) must be ≥ 0")
    dataset = read_records(manifest, split, files)
    if shard is not None and shard[0] > 1:
        dataset = dataset.shard(shard[0], shard[1])
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    if not isinstance(skip_batches, int) or skip_batches:
        # On records, before any batching: the same records as skipping `skip_batches` batches of batch_size.
        dataset = dataset.skip(skip_batches * batch_size)
    return batches_from_records(dataset, manifest, batch_size, drop_remainder=drop_remainder,
                                is_classification=is_classification)


def read_records(manifest: Manifest, split: str, files: Sequence[str] | None = None) -> tf.data.Dataset:
    """The serialized records of a split's shards (default every shard), in file order.

    Raises:
        ValueError: when the split has no shards or a path is not in the manifest.
    """
    uris = shard_uris(manifest, split, files)
    compression = "GZIP" if manifest.compression == "gzip" else ""
    return tf.data.TFRecordDataset(uris, compression_type=compression, buffer_size=READ_BUFFER_BYTES)


def batches_from_records(dataset: tf.data.Dataset, manifest: Manifest, batch_size: int, *,
                         drop_remainder: bool = False, is_classification: bool | None = None) -> tf.data.Dataset:
    """A stream of serialized records as parsed, prefetched batches of `(inputs, labels)` (see `create_dataset`)."""
    parse_rows = parse_batch_size(batch_size)
    # A partial last parse batch is kept when re-cutting: rebatch decides, by drop_remainder, about its tail.
    dataset = dataset.batch(parse_rows, drop_remainder=drop_remainder and parse_rows == batch_size)
    return batches_from_record_chunks(dataset, manifest, batch_size, drop_remainder=drop_remainder,
                                      is_classification=is_classification, rebatch=parse_rows != batch_size)


def batches_from_record_chunks(dataset: tf.data.Dataset, manifest: Manifest, batch_size: int, *,
                               drop_remainder: bool = False, is_classification: bool | None = None,
                               rebatch: bool = True) -> tf.data.Dataset:
    """Chunks of serialized records (1-D string tensors, parsed one chunk per call) as parsed, prefetched batches of
    `batch_size` (re-cut from the chunks unless `rebatch` is False: the chunks are the batches already)."""
    by_layout = make_layout_inputs_fn(manifest.feature_schema, manifest.record_layout, is_classification)
    # Either way the function's branches are on Python values only: left to AutoGraph (map's default), a fresh
    # process's first trace spent CPU converting it and what it calls, for nothing to convert.
    if by_layout is not None:  # every record has the manifest's byte layout: slice the values out, no parse
        dataset = dataset.map(tf.autograph.experimental.do_not_convert(by_layout),
                              num_parallel_calls=tf.data.AUTOTUNE)
    else:
        # tf.io.parse_example and the inputs in one parallel map per batch (the fused
        # tf.data.experimental.parse_example_dataset is deprecated and points at this form).
        dataset = dataset.map(tf.autograph.experimental.do_not_convert(
            make_parse_fn(manifest.feature_schema, is_classification)), num_parallel_calls=tf.data.AUTOTUNE)
    if rebatch:
        dataset = dataset.rebatch(batch_size, drop_remainder=drop_remainder)
    return dataset.prefetch(tf.data.AUTOTUNE)


def num_shard_records(manifest: Manifest, split: str, files: Sequence[str] | None, shard: tuple[int, int] | None) -> int:
    """Records one input pipeline sees per pass with these `files` and `shard` (no I/O)."""
    wanted = set(files) if files is not None else None
    total = sum(s.num_records for s in manifest.shards_for(split) if wanted is None or s.path in wanted)
    if shard is None or shard[0] <= 1:
        return total
    num_shards, index = shard
    return max(0, (total - index + num_shards - 1) // num_shards)
