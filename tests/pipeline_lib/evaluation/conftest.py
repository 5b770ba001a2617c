"""Shared set-up of the evaluation tests: a linear model with known weights over generated eval rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pipeline_lib.training import models
from tests.conftest import NUM_CLASSES, write_dataset

NUM_EVAL = 50


def linear_model(schema, weights: np.ndarray, bias: np.ndarray) -> keras.Model:
    """logits = numeric @ weights + bias; the string input is ignored."""
    inputs = models.create_inputs(schema)
    dense = keras.layers.Dense(weights.shape[1], name="linear")
    outputs = dense(inputs["numeric"])
    dense.set_weights([weights.astype(np.float32), bias.astype(np.float32)])
    return keras.Model(inputs, outputs)


@pytest.fixture
def classification_setup(tmp_path):
    manifest = write_dataset(str(tmp_path / "cls"), num_train=8, num_eval=NUM_EVAL)
    rng = np.random.default_rng(7)
    weights, bias = rng.normal(size=(5, NUM_CLASSES)), rng.normal(size=NUM_CLASSES)
    return manifest, linear_model(manifest.feature_schema, weights, bias), weights, bias
