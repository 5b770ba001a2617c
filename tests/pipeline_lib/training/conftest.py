"""Fixtures for the training tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_op_determinism():
    """TensorFlow's op determinism off for this test (an earlier `train.deterministic` run in this process leaves it
    on, and it refuses the clock op that times the input wait); restored afterwards."""
    from tensorflow.python.framework import config as tf_config

    was_on = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    yield
    if was_on:
        tf_config.enable_op_determinism()
