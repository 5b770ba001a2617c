"""Preprocessing inside the model on the wine table: mixed scales, missing cells, a string feature and a string
label train to within 5 % of a standardized logistic regression, and the export takes raw rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline_lib.config import OnBadRecord, parse_config
from pipeline_lib.data.convert import convert
from pipeline_lib.data.statistics import load_statistics
from pipeline_lib.evaluation import consolidation
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.planning import sharding
from pipeline_lib.serving import signatures
from pipeline_lib.training import input_pipeline, models, preprocessing
from pipeline_lib.training import loop as training
from tests.pipeline_lib.data.conversion_support import read_all
from tests.pipeline_lib.data.wine_support import (
    WINE_CLASSES,
    wine_frame,
    write_wine_csv,
)


def _config(root, source, **model):
    # The default data, model and train sections (5 epochs: 20 steps of 32 rows).
    return parse_config({"name": "wine", "data": {"source": source, "label": "cultivar"},
                         "output_root": str(root / "out"), "model": model,
                         "tracking": {"enabled": False}, "preflight": {"enabled": False}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("wine_train")
    source = write_wine_csv(root / "wine.csv", missing_rate=0.05)
    config = _config(root, source)
    manifest = convert(config.data, config.output_root)
    plan = sharding.plan_for_train(manifest, config.train, 1)
    result = training.train(config, manifest, plan, str(root / "run"))
    export = consolidation.consolidate(config, manifest, result, str(root / "run" / "export"))
    return config, manifest, export


def _logistic_regression_accuracy(manifest) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    _values, _target, names = wine_frame()
    train, test = read_all(manifest, "train"), read_all(manifest, "eval")
    x_train = np.stack([train[n] for n in names], axis=1).astype(np.float64)
    x_test = np.stack([test[n] for n in names], axis=1).astype(np.float64)
    means = np.nanmean(x_train, axis=0)
    x_train = np.where(np.isnan(x_train), means, x_train)
    x_test = np.where(np.isnan(x_test), means, x_test)
    scaler = StandardScaler().fit(x_train)
    model = LogisticRegression(max_iter=1000).fit(scaler.transform(x_train), train["cultivar"])
    return float(model.score(scaler.transform(x_test), test["cultivar"]))


def test_default_mlp_reaches_a_standardized_logistic_regression(trained):
    config, manifest, export = trained
    report = evaluation.evaluate(config, manifest, export.keras_path)
    baseline = _logistic_regression_accuracy(manifest)
    assert report.metrics["accuracy"] >= 0.95 * baseline, (report.metrics, baseline)
    assert report.class_names == list(WINE_CLASSES)  # the confusion matrix names the classes


def test_the_model_holds_imputation_normalization_and_a_vocabulary(trained):
    _config, manifest, export = trained
    model = keras.saving.load_model(export.keras_path, compile=False)
    layers = {layer.name: layer for layer in model.layers}
    assert isinstance(layers["impute"], preprocessing.Impute)
    assert isinstance(layers["normalize"], keras.layers.Normalization)
    lookup = layers["cellar_lookup"]
    assert isinstance(lookup, keras.layers.StringLookup) and set(lookup.get_vocabulary()[1:]) == {
        "north", "south", "east"}
    statistics = load_statistics(manifest)
    proline = statistics.feature("proline").numeric
    _values, _target, names = wine_frame()
    column = names.index("proline")
    assert layers["impute"].fill_values[column] == pytest.approx(proline.mean)
    assert float(np.asarray(layers["normalize"].mean).reshape(-1)[column]) == pytest.approx(proline.mean, rel=1e-6)


def test_exported_saved_model_on_raw_rows_matches_training_time_predictions(trained):
    config, manifest, export = trained
    dataset = input_pipeline.create_dataset(manifest, "eval", 64)
    inputs = next(iter(dataset))[0]
    assert bool(tf.reduce_any(tf.math.is_nan(inputs["numeric"])))  # raw rows with missing values among them
    assert b"" in inputs["cellar"].numpy().reshape(-1).tolist()
    training_model = models.create_model(config.model, manifest.feature_schema, load_statistics(manifest))
    checkpoint = tf.train.Checkpoint(model=training_model)
    checkpoint.read(export.checkpoint_path).expect_partial()
    expected = training_model(inputs, training=False).numpy()
    expected = tf.nn.softmax(expected).numpy()
    served = tf.saved_model.load(export.saved_model_dir).signatures["serving_default"]
    names = signatures.input_names(manifest.feature_schema)
    numeric = input_pipeline.numeric_features(manifest.feature_schema)
    raw = {names[spec.name]: inputs["numeric"][:, i] for i, spec in enumerate(numeric)}
    raw[names["cellar"]] = tf.reshape(inputs["cellar"], [-1])
    np.testing.assert_allclose(served(**raw)["probabilities"].numpy(), expected, rtol=1e-5, atol=1e-5)
    # A hand-written raw row: original units, a missing number, an unseen and a missing string.
    row = [13.2, np.nan, 2.4, 19.0, 100.0, 2.3, 2.0, 0.36, 1.6, 5.1, 0.95, 2.6, 750.0]
    keras_model = keras.saving.load_model(export.keras_path, compile=False)
    for cellar in (b"annex", b""):
        one = {names[spec.name]: tf.constant([value], tf.float32) for spec, value in zip(numeric, row)}
        one[names["cellar"]] = tf.constant([cellar])
        served_probabilities = served(**one)["probabilities"].numpy()
        packed = {"numeric": tf.constant([row], tf.float32), "cellar": tf.constant([[cellar]])}
        keras_probabilities = tf.nn.softmax(keras_model(packed, training=False)).numpy()
        assert np.all(np.isfinite(served_probabilities))
        np.testing.assert_allclose(served_probabilities, keras_probabilities, rtol=1e-5, atol=1e-5)


def test_normalize_false_keeps_raw_numbers_and_hashed_strings(trained, tmp_path):
    config, manifest, _export = trained
    raw_config = config.model_copy(update={"model": config.model.model_copy(update={"params": {"normalize": False}})})
    model = models.create_model(raw_config.model, manifest.feature_schema, load_statistics(manifest))
    names = {layer.name for layer in model.layers}
    assert "normalize" not in names and "cellar_hash" in names and "impute" in names


def test_custom_factories_receive_the_statistics(trained, tmp_path, monkeypatch):
    _config, manifest, _export = trained
    (tmp_path / "stats_factory.py").write_text(
        "import keras\n"
        "from pipeline_lib.training import models, preprocessing\n"
        "SEEN = {}\n"
        "def build(schema, num_outputs, statistics=None):\n"
        "    SEEN['statistics'] = statistics\n"
        "    inputs = models.create_inputs(schema)\n"
        "    parts = preprocessing.preprocess_inputs(inputs, schema, statistics)\n"
        "    x = keras.layers.Concatenate()(parts)\n"
        "    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from pipeline_lib.config import ModelConfig

    statistics = load_statistics(manifest)
    models.create_model(ModelConfig(factory="stats_factory:build"), manifest.feature_schema, statistics)
    import stats_factory

    assert stats_factory.SEEN["statistics"] is statistics


def test_a_missing_label_is_never_imputed(tmp_path):
    source = write_wine_csv(tmp_path / "wine.csv", missing_rate=0.05, missing_labels=4)
    from pipeline_lib.data.errors import ConversionError

    config = _config(tmp_path, source)
    with pytest.raises(ConversionError, match=r"column 'cultivar'.* is missing"):
        convert(config.data, config.output_root)
    skipping = config.data.model_copy(update={"on_bad_record": OnBadRecord.SKIP})
    manifest = convert(skipping, str(tmp_path / "skip"))
    assert manifest.num_bad_records == 4
    assert manifest.num_records("train") + manifest.num_records("eval") == len(wine_frame()[1]) - 4
    assert manifest.feature_schema.label_vocabulary == WINE_CLASSES


def test_missing_indicators_are_inputs_of_the_model(tmp_path):
    source = write_wine_csv(tmp_path / "wine.csv", missing_rate=0.05)
    config = parse_config({"data": {"source": source, "label": "cultivar", "missing_indicator": True,
                                    "missing_columns": {"ash": {"missing_indicator": False}}}})
    manifest = convert(config.data, str(tmp_path / "out"))
    model = models.create_model(config.model, manifest.feature_schema, load_statistics(manifest))
    indicators = model.get_layer("missing_indicators")
    _values, _target, names = wine_frame()
    assert indicators.columns == [i for i, n in enumerate(names) if n != "ash"]
    row = np.full((1, len(names)), 1.0, np.float32)
    row[0, names.index("proline")] = np.nan
    flags = keras.Model(model.inputs, indicators.output)({"numeric": row, "cellar": np.array([[b"north"]])})
    assert np.asarray(flags).tolist() == [[1.0 if n == "proline" else 0.0 for n in names if n != "ash"]]
