"""Tests for pipeline_lib.training.models: built-in factories, custom module:function factories, errors."""

from __future__ import annotations

import sys
import textwrap

import keras
import numpy as np
import pytest

from pipeline_lib.config import ModelConfig, Task
from pipeline_lib.training import input_pipeline, models
from tests.conftest import write_dataset


def _batch(manifest, size=8):
    return next(iter(input_pipeline.create_dataset(manifest, "train", size)))


@pytest.mark.parametrize("factory,params", [
    ("mlp", {"hidden_units": [16, 8], "dropout": 0.1, "activation": "tanh"}),
    ("cnn", {"image_shape": [5, 1, 1], "filters": [4], "kernel_size": 2, "dense_units": 8}),
])
def test_builtin_factories_give_logits(tiny_manifest, factory, params):
    model = models.create_model(ModelConfig(factory=factory, params=params), tiny_manifest.feature_schema)
    inputs, _ = _batch(tiny_manifest)
    logits = model(inputs)
    assert tuple(logits.shape) == (8, 3)
    assert any(isinstance(layer, keras.layers.Embedding) for layer in model.layers)


def test_regression_has_one_output(tmp_path):
    manifest = write_dataset(str(tmp_path / "reg"), num_train=16, task="regression")
    config = ModelConfig(factory="mlp", task=Task.REGRESSION, params={"hidden_units": [4]})
    assert models.num_outputs(config, manifest.feature_schema) == 1
    inputs, _ = _batch(manifest)
    assert tuple(models.create_model(config, manifest.feature_schema)(inputs).shape) == (8, 1)


def test_num_classes_from_config_overrides_schema(tiny_manifest):
    assert models.num_outputs(ModelConfig(num_classes=5), tiny_manifest.feature_schema) == 5
    assert models.num_outputs(ModelConfig(), tiny_manifest.feature_schema) == 3


def test_cnn_shape_mismatch_names_the_fix(tiny_manifest):
    with pytest.raises(models.ModelFactoryError, match=r"image_shape \[8, 8, 1\] holds 64 values .* 5 wide"):
        models.create_model(ModelConfig(factory="cnn", params={"image_shape": [8, 8, 1]}),
                            tiny_manifest.feature_schema)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(textwrap.dedent("""
        import keras

        from pipeline_lib.training import models

        def tiny(schema, num_outputs, width=4):
            inputs = {"numeric": keras.Input(shape=(5,), name="numeric"),
                      "color": keras.Input(shape=(1,), dtype="string", name="color")}
            x = keras.layers.Dense(width)(inputs["numeric"])
            return keras.Model(inputs, keras.layers.Dense(num_outputs)(x), name=f"tiny_{width}")

        def not_a_model(schema, num_outputs):
            return 42

        SEEN = []

        def protocol_factory(inputs):  # a ModelFactory: everything in one FactoryInputs
            SEEN.append(inputs)
            features = models.create_inputs(inputs.schema)
            x = keras.layers.Dense(inputs.params["width"])(features["numeric"])
            return keras.Model(features, keras.layers.Dense(inputs.num_outputs)(x))

        def two_arguments(a, b):
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_factories"
    sys.modules.pop("my_factories", None)


def test_custom_factory_is_imported_and_called_with_params(tiny_manifest, custom_module):
    model = models.create_model(ModelConfig(factory=f"{custom_module}:tiny", params={"width": 7}),
                                tiny_manifest.feature_schema)
    assert model.name == "tiny_7"
    inputs, _ = _batch(tiny_manifest)
    assert np.asarray(model(inputs)).shape == (8, 3)


@pytest.mark.parametrize("factory,message", [
    ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'"),
    ("my_factories:missing", r"has no function 'missing'"),
    ("my_factories:not_a_model", r"returned int, not a keras.Model"),
])
def test_bad_factory_errors_name_the_factory(tiny_manifest, custom_module, factory, message):
    with pytest.raises(models.ModelFactoryError, match=message) as caught:
        models.create_model(ModelConfig(factory=factory), tiny_manifest.feature_schema)
    assert factory in str(caught.value)


def test_a_model_factory_receives_one_factory_inputs_with_the_statistics(tiny_manifest, custom_module):
    from pipeline_lib.data.statistics import DatasetStatistics, SplitStatistics

    statistics = DatasetStatistics(label="label", splits={"train": SplitStatistics(num_rows=256, features={})})
    model = models.create_model(ModelConfig(factory=f"{custom_module}:protocol_factory", params={"width": 3}),
                                tiny_manifest.feature_schema, statistics)
    [inputs] = sys.modules[custom_module].SEEN
    assert isinstance(inputs, models.FactoryInputs)
    assert inputs.statistics is statistics and inputs.schema == tiny_manifest.feature_schema
    assert inputs.num_outputs == 3 and inputs.task == Task.CLASSIFICATION and inputs.params == {"width": 3}
    assert np.asarray(model(_batch(tiny_manifest)[0])).shape == (8, 3)


def test_a_factory_that_cannot_take_factory_inputs_is_refused_at_import_naming_the_protocol(custom_module):
    with pytest.raises(models.ModelFactoryError,
                       match=r"'my_factories:two_arguments' cannot be called with one FactoryInputs .*"
                             r"define it as a pipeline_lib\.training\.models\.ModelFactory"):
        models.import_factory(f"{custom_module}:two_arguments")
    assert models.import_factory(f"{custom_module}:protocol_factory")  # and the older keyword form:
    assert models.import_factory(f"{custom_module}:tiny")


def test_bad_params_name_the_factory(tiny_manifest, custom_module):
    with pytest.raises(models.ModelFactoryError, match=r"'my_factories:tiny' rejected model.params \['depth'\]"):
        models.create_model(ModelConfig(factory="my_factories:tiny", params={"depth": 3}),
                            tiny_manifest.feature_schema)


def test_a_regression_factory_receives_the_labels_statistics_and_opts_in_with_create_head(tmp_path, custom_module):
    from pipeline_lib.data.manifest import DType
    from pipeline_lib.data.statistics import (
        DatasetStatistics,
        FeatureStatistics,
        NumericStatistics,
        SplitStatistics,
    )

    manifest = write_dataset(str(tmp_path / "reg"), num_train=16, task="regression")
    label = NumericStatistics(count=16, missing=0, min=1000.0, max=3000.0, mean=2000.0, variance=250_000.0)
    statistics = DatasetStatistics(label="label", splits={"train": SplitStatistics(num_rows=16, features={
        "label": FeatureStatistics(dtype=DType.FLOAT32, numeric=label)})})
    config = ModelConfig(factory=f"{custom_module}:protocol_factory", task=Task.REGRESSION, params={"width": 3})
    plain = models.create_model(config, manifest.feature_schema, statistics)
    [inputs] = sys.modules[custom_module].SEEN
    assert inputs.label_statistics == label
    # Ignoring it (this factory's own Dense head) opts out; ending with create_head opts in.
    assert "label_units" not in [layer.name for layer in plain.layers]
    features = models.create_inputs(manifest.feature_schema)
    head = models.create_head(keras.layers.Dense(3)(features["numeric"]), inputs)
    scaled = keras.Model(features, head)
    scaled.get_layer("logits").set_weights([np.zeros((3, 1), np.float32), np.zeros(1, np.float32)])
    np.testing.assert_allclose(np.asarray(scaled(_batch(manifest)[0])), 2000.0)
    assert scaled.get_layer("label_units").get_config()["scale"] == pytest.approx(500.0)
