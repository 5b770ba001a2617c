"""Scoring raw rows with date and timestamp columns: datetimes, dates, ISO strings and nulls become the int64 instants
the model was trained on; a model trained a few steps on a Parquet table with timestamps exports, passes the model check
through both public loaders, and scores DataFrames, and `tfdag predict` a Parquet table, with datetimes and ISO
strings alike.

The end-to-end fixture trains 4 steps and starts one fresh interpreter (TensorFlow and MLflow, ~10 s)."""

from __future__ import annotations

import datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.config import PredictConfig, Task, parse_config
from pipeline_lib.data.manifest import TimeKind
from pipeline_lib.data.statistics import MISSING_INT64
from pipeline_lib.prediction.predict import predict
from pipeline_lib.serving import tfdag_scoring, validation
from pipeline_lib.serving.tfdag_scoring import (
    RawRowError,
    instant_of,
    to_tensors,
)
from pipeline_lib.tracking import model_logging
from pipeline_lib.tracking.client import global_tracking_uri
from tests.pipeline_lib.serving.model_support import train_export_and_log

UTC = datetime.UTC
MICROS_PER_DAY = 86_400_000_000


def test_a_time_column_converts_from_datetime64_objects_and_strings_and_names_a_bad_value():
    columns = [{"name": "at", "dtype": "timestamp", "shape": []}, {"name": "day", "dtype": "date", "shape": []}]
    stamps = pd.Series(pd.to_datetime(["1965-03-01 05:06:07.000008", None, "2024-02-29 23:00:00.000000"]))
    expected_at = [instant_of(v, "timestamp") if v is not pd.NaT else MISSING_INT64 for v in stamps]
    expected_day = [v // MICROS_PER_DAY if v != MISSING_INT64 else v for v in expected_at]
    frames = [
        pd.DataFrame({"at": stamps, "day": stamps}),  # naive: UTC
        pd.DataFrame({"at": stamps.dt.tz_localize("UTC").dt.tz_convert("Asia/Tokyo"),
                      "day": stamps.dt.tz_localize("UTC")}),
        pd.DataFrame({"at": [v.isoformat() if v is not pd.NaT else None for v in stamps],
                      "day": [v.date().isoformat() if v is not pd.NaT else "" for v in stamps]}),
        pd.DataFrame({"at": [v.to_pydatetime() if v is not pd.NaT else None for v in stamps],
                      "day": [v.date() if v is not pd.NaT else np.nan for v in stamps]}, dtype=object),
    ]
    for frame in frames:
        tensors = to_tensors(columns, frame)
        assert tensors["at"].dtype == np.int64 and tensors["at"].tolist() == expected_at
        assert tensors["day"].tolist() == expected_day
    with pytest.raises(RawRowError, match=r"column 'at', row 1: 'soon' is not an ISO 8601 date or timestamp") as raised:
        to_tensors(columns, pd.DataFrame({"at": ["2020-01-01", "soon"], "day": ["2020-01-01", None]}))
    assert (raised.value.column, raised.value.row) == ("at", 1)


# --- end to end -----------------------------------------------------------------------------------------------------

NUM_ROWS = 240


def _clock_table(path) -> pa.Table:
    """Rows whose label is whether the hour is in the afternoon: a timestamp (some missing), a date and a number."""
    rng = np.random.default_rng(11)
    micros = rng.integers(-200 * 365 * MICROS_PER_DAY // 10, 60 * 365 * MICROS_PER_DAY, size=NUM_ROWS)
    missing = np.arange(NUM_ROWS) % 17 == 3
    table = pa.table({
        "at": pa.array(micros, pa.timestamp("us", tz="UTC"), mask=missing),
        "day": pa.array((micros // MICROS_PER_DAY).astype(np.int32), pa.date32()),
        "x": rng.normal(size=NUM_ROWS),
        "afternoon": (micros % MICROS_PER_DAY >= MICROS_PER_DAY // 2).astype(np.int64),
    })
    pq.write_table(table, path)
    return table


@pytest.fixture(scope="module")
def clock(tmp_path_factory):
    """The clock table trained 4 steps, exported, logged to a sqlite store, and checked in a fresh process."""
    root = tmp_path_factory.mktemp("clock")
    _clock_table(root / "clock.parquet")
    config = parse_config({"name": "clock", "data": {"source": str(root / "clock.parquet"), "label": "afternoon"},
                           "output_root": str(root / "out"), "train": {"steps": 4},
                           "tracking": {"experiment": "clock"}, "preflight": {"enabled": False}})
    made = train_export_and_log(config, root)
    manifest, export, logged, sample = made.manifest, made.export, made.logged, made.sample
    check = validation.validate_model(export.saved_model_dir, export.keras_path, logged.model_uri, config.mlflow_uri,
                                      sample, manifest.feature_schema, Task.CLASSIFICATION)
    return root, config, manifest, export, logged, sample, check


def test_a_model_on_timestamps_exports_passes_the_model_check_and_records_the_source_types(clock):
    _root, _config, manifest, export, _logged, sample, check = clock
    specs = {f.name: f for f in manifest.feature_schema.features}
    assert (specs["at"].time, specs["day"].time) == (TimeKind.TIMESTAMP, TimeKind.DATE)
    assert check.passed, check.reason
    assert [c.loader for c in check.checks] == [validation.SAVED_MODEL_LOADER, validation.PYFUNC_LOADER]
    assert str(sample["at"].dtype) == "datetime64[us]" and check.rows_with_missing > 0  # NaT rows too
    columns = {c["name"]: c for c in tfdag_scoring.read_serving_spec(export.saved_model_dir)["columns"]}
    assert (columns["at"]["dtype"], columns["at"]["source_type"]) == ("timestamp", "timestamp[us, tz=UTC]")
    assert (columns["day"]["dtype"], columns["day"]["source_type"]) == ("date", "date32[day]")
    assert columns["x"]["source_type"] == "float32"
    signature = model_logging.model_signature(manifest.feature_schema, pd.DataFrame({"prediction": [0]}))
    assert {spec.name: spec.type.name for spec in signature.inputs.inputs} == {
        "at": "datetime", "day": "datetime", "x": "double"}


def test_the_pyfunc_scores_datetimes_and_iso_strings_alike_and_tfdag_predict_scores_the_parquet_table(clock):
    import mlflow

    root, config, _manifest, export, logged, sample, _check = clock
    frame = sample[["at", "day", "x"]]
    naive_text = [v.isoformat() if v is not pd.NaT else None for v in frame["at"]]
    as_text = frame.assign(at=[v + "Z" if v else None for v in naive_text],
                           day=[v.date().isoformat() if v is not pd.NaT else None for v in frame["day"]])
    aware = frame.assign(at=frame["at"].dt.tz_localize("UTC").dt.tz_convert("America/Denver"))
    scorer = tfdag_scoring.Scorer(export.saved_model_dir)
    expected = scorer.predict(frame)
    for other in (as_text, aware):
        pd.testing.assert_frame_equal(scorer.predict(other), expected)
    with global_tracking_uri(config.mlflow_uri):
        pyfunc = mlflow.pyfunc.load_model(logged.model_uri)
    # Through MLflow's own check of the signature's datetime columns: naive datetimes (UTC) as they are, and the
    # JSON rows `mlflow models serve` takes, ISO strings without an offset, which it parses by the signature.
    pd.testing.assert_frame_equal(pyfunc.predict(frame), expected, check_dtype=False)
    from mlflow.pyfunc.scoring_server import infer_and_parse_data

    records = [{"at": at, "day": day, "x": x} for at, day, x in zip(naive_text, as_text["day"], frame["x"])]
    served = infer_and_parse_data({"dataframe_records": records}, pyfunc.metadata.get_input_schema())
    pd.testing.assert_frame_equal(pyfunc.predict(served), expected, check_dtype=False)

    result = predict(PredictConfig(model=export.export_dir, input=str(root / "clock.parquet"),
                                   output=str(root / "scored.parquet"), keep=("x",)))
    assert (result.num_rows, result.num_skipped) == (NUM_ROWS, 0)
    scored = pq.read_table(root / "scored.parquet").to_pandas()
    table = pq.read_table(root / "clock.parquet").to_pandas()
    direct = scorer.predict(table)
    np.testing.assert_allclose(scored["probability_1"], direct["probability_1"], rtol=1e-6)
