"""The signatures' input names: every column name a table can hold maps to a distinct name TensorFlow keeps as it is."""

from __future__ import annotations

import keyword

from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.serving import signatures


def _schema(*names: str) -> Schema:
    return Schema(features=tuple(FeatureSpec(name=n, dtype=DType.FLOAT32) for n in names),
                  label=FeatureSpec(name="label", dtype=DType.INT64), num_classes=2)


def test_any_column_name_maps_to_a_distinct_python_parameter_name():
    odd = ["class", "None", "True", "from", "lambda", "self", "x y", "x_y", "a.b", "a-b", "a_b", "1st", "c1st",
           "café", "日本", "_u", "%", "", "class_", "size", "match"]

    names = signatures.input_names(_schema(*odd))

    assert list(names) == odd and len(set(names.values())) == len(odd)
    for name in names.values():
        # What TensorFlow's sanitize_arg_name leaves alone, and inspect.Parameter accepts.
        assert name.isascii() and name.isidentifier() and name[0].isalpha(), name
        assert not keyword.iskeyword(name) and name != "self", name
    assert names["size"] == "size" and names["match"] == "match"  # a plain name (a soft keyword too) stays
    assert (names["class"], names["None"], names["self"], names["1st"]) == ("class_", "None_", "self_", "c1st")
    assert (names["x y"], names["x_y"]) == ("x_y", "x_y_2")  # first come, first served


def test_a_model_on_string_time_and_number_columns_of_any_name_builds_exports_and_serves(tmp_path):
    """Inputs and layers take the columns' safe names, and a string column named `numeric` keeps its own input."""
    import numpy as np
    import tensorflow as tf

    from pipeline_lib.config import ModelConfig, Task
    from pipeline_lib.data.manifest import TimeKind
    from pipeline_lib.training.column_names import NUMERIC_KEY
    from pipeline_lib.training.models import create_model

    strings = ["numeric", "my col", "wé/ü", "class", "1st"]
    schema = Schema(features=(
        FeatureSpec(name="x y", dtype=DType.FLOAT32),
        *(FeatureSpec(name=n, dtype=DType.STRING) for n in strings),
        FeatureSpec(name="numeric (column)", dtype=DType.INT64, time=TimeKind.DATE, source_type="date32[day]")),
        label=FeatureSpec(name="label", dtype=DType.INT64), num_classes=2)
    model = create_model(ModelConfig(), schema)
    assert set(model.input) == {NUMERIC_KEY, *signatures.input_names(schema).values()} - {"x_y"}
    signatures.export_saved_model(model, schema, Task.CLASSIFICATION, str(tmp_path / "saved"))
    serve = tf.saved_model.load(str(tmp_path / "saved")).signatures["serving_default"]
    names = signatures.input_names(schema)
    assert names["numeric"] == "numeric_" and NUMERIC_KEY not in names.values()
    inputs = {names["x y"]: tf.constant([1.0, 2.0]), names["numeric (column)"]: tf.constant([0, 19_000], tf.int64),
              **{names[n]: tf.constant([["a"], ["b"]]) for n in strings}}
    served = serve(**inputs)["probabilities"].numpy()
    direct = model(signatures.raw_to_model_inputs(schema, inputs), training=False).numpy()
    np.testing.assert_allclose(served, tf.nn.softmax(direct).numpy(), atol=1e-6)
