"""Calendar parts of date and timestamp features inside the model, against Python's datetime: instants before 1970,
leap days, century years; the encoding layer's fixed width, imputation and missing values; the model inputs."""

from __future__ import annotations

import datetime

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.data.manifest import DType, FeatureSpec, Schema, TimeKind
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.training import input_pipeline
from pipeline_lib.training.calendar_parts import (
    MICROS_PER_DAY,
    CalendarFeatures,
    calendar_parts,
    width,
    year_constants,
)

EPOCH = datetime.datetime(1970, 1, 1)
# Days that trip calendar arithmetic: leap days (2000 is a leap year, 1900 and 2100 are not), the turns of
# centuries and eras, the day before the epoch, and far years.
EDGE_DATES = [datetime.date(y, m, d) for y, m, d in (
    (2000, 2, 29), (2000, 3, 1), (1900, 2, 28), (1900, 3, 1), (2100, 2, 28), (2100, 3, 1), (1600, 2, 29),
    (1969, 12, 31), (1970, 1, 1), (1999, 12, 31), (2024, 2, 29), (1, 1, 1), (9999, 12, 31), (1583, 10, 15))]


def _micros(moment: datetime.datetime) -> int:
    return (moment - EPOCH) // datetime.timedelta(microseconds=1)


def test_timestamp_parts_match_python_for_random_instants_before_and_after_1970_and_edge_days():
    rng = np.random.default_rng(7)
    low, high = _micros(datetime.datetime(1, 1, 1)), _micros(datetime.datetime(9999, 12, 31, 23, 59, 59))
    instants = rng.integers(low, high, size=3000).tolist()
    instants += [_micros(datetime.datetime.combine(d, datetime.time(h, 59, 59, 999_999)))
                 for d in EDGE_DATES for h in (0, 23)]
    instants += [-1, 0, 1, MICROS_PER_DAY - 1, -MICROS_PER_DAY]  # microseconds around midnight of the epoch
    parts = {k: v.numpy() for k, v in calendar_parts(tf.constant(instants, tf.int64), TimeKind.TIMESTAMP).items()}
    expected = [EPOCH + datetime.timedelta(microseconds=i) for i in instants]
    assert parts["year"].tolist() == [e.year for e in expected]
    assert parts["month"].tolist() == [e.month for e in expected]
    assert parts["day_of_week"].tolist() == [e.weekday() for e in expected]
    assert parts["hour"].tolist() == [e.hour for e in expected]
    assert any(i < 0 for i in instants) and parts["year"].min() < 1970


def test_date_parts_match_python_for_random_days_and_edge_days():
    rng = np.random.default_rng(8)
    ordinal = EPOCH.toordinal()
    days = rng.integers(1 - ordinal, datetime.date(9999, 12, 31).toordinal() - ordinal, size=3000).tolist()
    days += [d.toordinal() - ordinal for d in EDGE_DATES]
    parts = {k: v.numpy() for k, v in calendar_parts(tf.constant(days, tf.int64), "date").items()}
    expected = [datetime.date.fromordinal(d + ordinal) for d in days]
    assert set(parts) == {"year", "month", "day_of_week"}  # no hour for a date
    assert parts["year"].tolist() == [e.year for e in expected]
    assert parts["month"].tolist() == [e.month for e in expected]
    assert parts["day_of_week"].tolist() == [e.weekday() for e in expected]


def test_the_layer_encodes_a_fixed_set_of_parts_and_a_missing_instant_as_the_imputed_year_and_zeros():
    moment = datetime.datetime(1968, 2, 29, 22, 30)  # a Thursday, before 1970, a leap day
    layer = CalendarFeatures("timestamp", year_fill=2000.0, year_mean=1990.0, year_std=10.0, indicator=True)
    out = layer(tf.constant([[_micros(moment)], [MISSING_INT64]], tf.int64)).numpy()
    assert out.shape == (2, width("timestamp", indicator=True)) == (2, 1 + 12 + 7 + 24 + 1)
    present, missing = out
    assert present[0] == pytest.approx((1968 - 1990) / 10)
    assert present[1:13].tolist() == [float(m == 2) for m in range(1, 13)]
    assert present[13:20].tolist() == [float(d == 3) for d in range(7)]
    assert present[20:44].tolist() == [float(h == 22) for h in range(24)]
    assert present[44] == 0.0
    assert missing[0] == pytest.approx((2000 - 1990) / 10) and missing[1:44].sum() == 0 and missing[44] == 1.0
    dates = CalendarFeatures("date")(tf.constant([[0]], tf.int64)).numpy()  # 1970-01-01: a Thursday in January
    assert dates.shape == (1, width("date")) == (1, 20)
    assert dates[0, 0] == 1970.0 and dates[0, 1] == 1.0 and dates[0, 13 + 3] == 1.0
    restored = CalendarFeatures.from_config(layer.get_config())
    np.testing.assert_array_equal(restored(tf.constant([[0]], tf.int64)), layer(tf.constant([[0]], tf.int64)))


def test_year_constants_come_from_the_instant_statistics_with_at_least_one_year_of_spread():
    year = 365.2425 * MICROS_PER_DAY
    fill, mean, std = year_constants("timestamp", 30 * year, (0.1 * year) ** 2, None)
    assert (fill, mean, std) == (pytest.approx(2000.0), pytest.approx(2000.0), 1.0)
    fill, mean, std = year_constants("date", 365.2425 * 50, (365.2425 * 5) ** 2, 0.0)
    assert (fill, mean, std) == (1970.0, pytest.approx(2020.0), pytest.approx(5.0))
    assert year_constants("date", None, None, None) == (1970.0, 1970.0, 1.0)


def test_a_time_feature_is_its_own_int64_input_and_stays_out_of_the_numeric_matrix():
    schema = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32),
                              FeatureSpec(name="when", dtype=DType.INT64, time=TimeKind.TIMESTAMP,
                                          source_type="timestamp[us]")),
                    label=FeatureSpec(name="y", dtype=DType.INT64), num_classes=2)
    assert input_pipeline.feature_width(schema) == 1
    signature = input_pipeline.input_signature(schema)
    assert signature["when"].dtype == tf.int64 and signature["when"].shape.as_list() == [None, 1]
    example = tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=[1.5])),
        "when": tf.train.Feature(int64_list=tf.train.Int64List(value=[1_700_000_000_123_456])),
        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[1]))}))
    inputs, _labels = input_pipeline.make_parse_fn(schema)(tf.constant([example.SerializeToString()]))
    assert inputs["when"].dtype == tf.int64 and inputs["when"].numpy().tolist() == [[1_700_000_000_123_456]]
    assert inputs["numeric"].numpy().tolist() == [[1.5]]
    keras_inputs = {name: keras.Input(shape=spec.shape[1:], dtype=spec.dtype.name, name=name)
                    for name, spec in signature.items()}
    assert keras_inputs["when"].dtype == "int64"


def test_a_model_on_time_columns_of_any_name_exports_and_serves_the_instants(tmp_path):
    from pipeline_lib.config import ModelConfig, Task
    from pipeline_lib.serving import signatures
    from pipeline_lib.training.models import create_model

    schema = Schema(features=(
        FeatureSpec(name="x", dtype=DType.FLOAT32),
        FeatureSpec(name="when (UTC) é", dtype=DType.INT64, time=TimeKind.TIMESTAMP, source_type="timestamp[us]"),
        FeatureSpec(name="when (UTC) ü", dtype=DType.INT64, time=TimeKind.DATE, source_type="date32[day]")),
        label=FeatureSpec(name="y", dtype=DType.INT64), num_classes=2)
    model = create_model(ModelConfig(), schema)
    assert sum(isinstance(layer, CalendarFeatures) for layer in model.layers) == 2
    signatures.export_saved_model(model, schema, Task.CLASSIFICATION, str(tmp_path / "saved"))
    serve = tf.saved_model.load(str(tmp_path / "saved")).signatures["serving_default"]
    names = signatures.input_names(schema)
    assert serve.structured_input_signature[1][names["when (UTC) é"]].dtype == tf.int64
    inputs = {names["x"]: tf.constant([1.0, 2.0]), names["when (UTC) é"]: tf.constant([0, MISSING_INT64], tf.int64),
              names["when (UTC) ü"]: tf.constant([-1, 19_000], tf.int64)}
    served = serve(**inputs)["probabilities"].numpy()
    direct = model(signatures.raw_to_model_inputs(schema, inputs), training=False).numpy()
    np.testing.assert_allclose(served, tf.nn.softmax(direct).numpy(), atol=1e-6)
