"""The logged model's MLflow signature on raw rows: the table's columns with their types, missing cells allowed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from mlflow.models import validate_schema

from pipeline_lib.data.manifest import DType, FeatureSpec, Schema
from pipeline_lib.tracking import model_logging

SCHEMA = Schema(features=(FeatureSpec(name="x", dtype=DType.FLOAT32, shape=(2,)),
                          FeatureSpec(name="size", dtype=DType.INT64),
                          FeatureSpec(name="color", dtype=DType.STRING)),
                label=FeatureSpec(name="label", dtype=DType.INT64), num_classes=2)
OUTPUTS = pd.DataFrame({"prediction": np.array([1], np.int64), "probability_0": np.array([0.4], np.float32),
                        "probability_1": np.array([0.6], np.float32)})


def test_signature_takes_raw_rows_with_missing_cells_of_every_kind():
    signature = model_logging.model_signature(SCHEMA, OUTPUTS)
    inputs = {spec.name: spec for spec in signature.inputs.inputs}
    assert list(inputs) == ["x", "size", "color"]
    assert (repr(inputs["x"].type), inputs["size"].type.name, inputs["color"].type.name) == (
        "Array(double)", "double", "string")
    # A missing vector (None), a missing number (NaN) and a missing string (None) in one batch, and an extra column.
    rows = pd.DataFrame({"x": [[0.5, 1.0], None], "size": [3.0, np.nan], "color": ["red", None], "note": ["a", "b"]})
    validate_schema(rows, signature.inputs)
    with pytest.raises(MlflowException, match="size"):
        validate_schema(rows.drop(columns=["size"]), signature.inputs)
