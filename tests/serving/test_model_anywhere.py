"""The delivered model is usable where tfdag is not installed: the registered MLflow model in a clean virtualenv of
its recorded requirements, `mlflow models serve` on loopback, and the SavedModel's two signatures, all on the wine
table's raw rows (strings as strings, missing cells as None/NaN/null, extra columns ignored)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import keras
import mlflow
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from pipeline_lib.serving import rows as raw
from pipeline_lib.serving import tfdag_scoring
from pipeline_lib.tracking.client import global_tracking_uri
from pipeline_lib.training import input_pipeline
from tests.pipeline_lib.data.wine_support import WINE_CLASSES
from tests.serving.conftest import CHAMPION, CLASSIFIER, REGRESSOR, run_in_venv

PROBABILITIES = [tfdag_scoring.probability_column(c) for c in WINE_CLASSES]


def _user_rows(registered, num_rows: int = 6) -> pd.DataFrame:
    """Raw eval rows as a user would send them: a None string, an unseen string, NaN numbers, an extra column."""
    frame = raw.raw_rows(registered.manifest, num_rows)
    strings = [s.name for s in registered.manifest.feature_schema.features if s.dtype.value == "string"]
    numbers = [s.name for s in registered.manifest.feature_schema.features if s.dtype.value != "string"]
    frame[strings[0]] = frame[strings[0]].astype(object)
    frame.loc[0, strings[0]] = None
    frame.loc[1, strings[0]] = "annex"  # never seen in training
    frame.loc[2, numbers[:3]] = np.nan
    frame["note"] = [f"row {i}" for i in range(num_rows)]  # not a column of the model
    return frame


def _expected(registered, frame: pd.DataFrame) -> pd.DataFrame:
    """Predictions computed here, in the test process (tfdag installed), from the export's SavedModel."""
    return tfdag_scoring.Scorer(registered.export.saved_model_dir).predict(frame)


def _assert_same_predictions(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    assert list(got.columns) == list(expected.columns)
    if expected["prediction"].dtype.kind == "f":
        np.testing.assert_allclose(got["prediction"].to_numpy(float), expected["prediction"].to_numpy(float),
                                   rtol=1e-5, atol=1e-5)
    else:
        assert got["prediction"].tolist() == expected["prediction"].tolist()
    probabilities = [c for c in expected.columns if c != "prediction"]
    if probabilities:
        np.testing.assert_allclose(got[probabilities].to_numpy(float), expected[probabilities].to_numpy(float),
                                   rtol=1e-5, atol=1e-5)


def test_signature_lists_the_columns_and_the_input_example_is_raw_rows(served_models, tmp_path):
    classifier = served_models.classifier
    uri = f"models:/{CLASSIFIER}/{classifier.version}"
    with global_tracking_uri(served_models.tracking_uri):
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "model"))
    model = mlflow.models.Model.load(local)
    inputs = model.get_input_schema().inputs
    features = classifier.manifest.feature_schema.features
    assert [s.name for s in inputs] == [f.name for f in features]
    assert {s.name: s.type.name for s in inputs} == {f.name: "string" if f.dtype.value == "string" else "double"
                                                     for f in features}
    assert [s.name for s in model.get_output_schema().inputs] == ["prediction", *PROBABILITIES]
    example = model.load_input_example(local)
    # The first eval rows, in the source's units and strings; with this seed they hold a missing number and a
    # missing cellar.
    expected = raw.raw_rows(classifier.manifest, len(example))
    pd.testing.assert_frame_equal(example.reset_index(drop=True), expected, check_dtype=False)
    assert example.drop(columns="cellar").isna().any().any() and example["cellar"].isna().any()
    assert set(example["cellar"].dropna()) <= {"north", "south", "east"}
    assert example["proline"].min() > 100  # original units, not normalized
    # The raw-row path gives the training path's numbers: the SavedModel on raw rows == the Keras model on the
    # training pipeline's inputs of the same records.
    frame = raw.raw_rows(classifier.manifest, 16)
    inputs, _ = next(iter(input_pipeline.create_dataset(classifier.manifest, "eval", 16)))
    logits = keras.saving.load_model(classifier.export.keras_path, compile=False)(inputs, training=False)
    np.testing.assert_allclose(_expected(classifier, frame)[PROBABILITIES].to_numpy(),
                               tf.nn.softmax(logits).numpy(), rtol=1e-5, atol=1e-5)


def _columns(scorer: tfdag_scoring.Scorer, rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """One named input per column, as a TF Serving client sends them: NaN for a missing number, "" for a string."""
    return {c["input"]: (np.asarray([b"" if pd.isna(v) else v.encode() for v in rows[c["name"]]], dtype=object)
                         if c["dtype"] == "string" else rows[c["name"]].to_numpy(np.float32))
            for c in scorer.columns}


def _example(row: pd.Series, columns: list[dict]) -> bytes:
    """A tf.train.Example as a TF Serving client builds it: a missing cell is an absent feature."""
    feature = {}
    for column in columns:
        value = row[column["name"]]
        if pd.isna(value):
            continue
        if column["dtype"] == "string":
            feature[column["name"]] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode()]))
        elif column["source_dtype"] == "int64":
            feature[column["name"]] = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(value)]))
        else:
            feature[column["name"]] = tf.train.Feature(float_list=tf.train.FloatList(value=[float(value)]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


@pytest.fixture(scope="module")
def clean_venv_answers(served_models, clean_venv, tmp_path_factory):
    """What the clean venv's python answers: the registered models through `mlflow.pyfunc` and the classifier's
    SavedModel through its two signatures. One process, so TensorFlow and MLflow load once: 14-25 s measured."""
    classifier, regressor = served_models.classifier, served_models.regressor
    rows, regression_rows = _user_rows(classifier), _user_rows(regressor)
    calls = [(f"models:/{CLASSIFIER}/{classifier.version}", rows), (f"models:/{CLASSIFIER}@{CHAMPION}", rows),
             (f"models:/{REGRESSOR}/{regressor.version}", regression_rows)]
    scorer = tfdag_scoring.Scorer(classifier.export.saved_model_dir)
    examples = [_example(row, scorer.columns) for _, row in rows.iterrows()]
    request = {"pyfunc": {"calls": calls, "missing_column": "cellar"},
               "saved_model": {"saved_model_dir": classifier.export.saved_model_dir,
                               "columns": _columns(scorer, rows), "examples": examples}}
    answers = run_in_venv(clean_venv, tmp_path_factory.mktemp("clean_venv_answers"), request,
                          MLFLOW_TRACKING_URI=served_models.tracking_uri)
    return request, answers


def test_registered_models_predict_raw_rows_in_a_clean_venv_without_tfdag(served_models, clean_venv_answers):
    request, answers = clean_venv_answers
    assert not answers["tfdag_importable"] and answers["tfdag_modules"] == []
    result = answers["pyfunc"]
    assert set(result["model_modules"].values()) == {"tfdag_scoring"}  # the copy shipped in the model's code/
    (classifier_uri, rows), (champion_uri, _), (regressor_uri, regression_rows) = request["pyfunc"]["calls"]
    expected = _expected(served_models.classifier, rows)
    for uri in (classifier_uri, champion_uri):
        got = result["predictions"][uri]
        _assert_same_predictions(got, expected)
        assert set(got["prediction"]) <= set(WINE_CLASSES)
    regression = result["predictions"][regressor_uri]
    assert list(regression.columns) == ["prediction"] and regression["prediction"].dtype.kind == "f"
    _assert_same_predictions(regression, _expected(served_models.regressor, regression_rows))
    assert "cellar" in result["missing_error"] and "missing" in result["missing_error"].lower()


def test_saved_model_signatures_answer_in_a_process_without_tfdag(served_models, clean_venv_answers):
    request, answers = clean_venv_answers
    assert not answers["tfdag_importable"] and answers["tfdag_modules"] == []
    result, sent = answers["saved_model"], request["saved_model"]
    assert result["serving_default_inputs"] == sorted(sent["columns"])
    assert result["serve_examples_inputs"] == ["examples"]
    # Some Examples lack a feature (a missing cell), and some inputs carry NaN and "".
    assert any(len(tf.train.Example.FromString(e).features.feature) < len(sent["columns"]) for e in sent["examples"])
    assert b"" in sent["columns"]["cellar"].tolist() and np.isnan(sent["columns"]["ash"]).any()
    expected = _expected(served_models.classifier, request["pyfunc"]["calls"][0][1])
    for signature in ("serving_default", "serve_examples"):
        outputs = result[signature]
        got = pd.DataFrame({"prediction": [p.decode() for p in outputs["prediction"]],
                            **{c: outputs["probabilities"][:, i] for i, c in enumerate(PROBABILITIES)}})
        _assert_same_predictions(got, expected)


def _records(frame: pd.DataFrame) -> list[dict]:
    """The rows as JSON objects: a missing cell is null."""
    return [{k: (None if pd.isna(v) else v) for k, v in row.items()}
            for row in frame.to_dict(orient="records")]


def _post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload, allow_nan=False).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_mlflow_models_serve_answers_raw_rows(served_models, scoring_server):
    rows = _user_rows(served_models.classifier)
    expected = _expected(served_models.classifier, rows)
    records = _records(rows)
    split = {"columns": list(rows.columns), "data": [list(r.values()) for r in records]}

    for payload in ({"dataframe_split": split}, {"dataframe_records": records}):
        status, body = _post(scoring_server.url, payload)
        assert status == 200, body
        _assert_same_predictions(pd.DataFrame(body["predictions"]), expected)

    # A CSV body, as RFC 4180 writes a table that converts: a quoted text value holding a line break, a quote, the
    # delimiter and non-ASCII characters; the server reads it with pandas.
    strings = [s.name for s in served_models.classifier.manifest.feature_schema.features if s.dtype.value == "string"]
    text = rows.assign(**{strings[0]: ['Zürich\r\nline 2, "quoted"'] + rows[strings[0]].tolist()[1:]}).to_csv(index=False)
    request = urllib.request.Request(f"{scoring_server.url}/invocations", data=text.encode(),
                                     headers={"Content-Type": "text/csv"})
    with urllib.request.urlopen(request, timeout=60) as response:
        got = pd.DataFrame(json.loads(response.read())["predictions"])
    _assert_same_predictions(got, _expected(served_models.classifier, pd.read_csv(io.StringIO(text))))

    # A column of nulls only: pandas makes it an object column of None, still a missing value per row.
    status, body = _post(scoring_server.url, {"dataframe_records": [{**r, "cellar": None} for r in records]})
    assert status == 200, body
    _assert_same_predictions(pd.DataFrame(body["predictions"]), _expected(served_models.classifier,
                                                                          rows.assign(cellar=None)))
    status, body = _post(scoring_server.url, {"dataframe_records": [{k: v for k, v in r.items() if k != "proline"}
                                                                    for r in records]})
    assert status == 400 and "proline" in body["message"], body


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
