"""train.jit_compile: the step's forward and backward pass compiled by XLA on CPU still learns digits."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from pipeline_lib.training import loop as training
from pipeline_lib.training import models
from pipeline_lib.training.errors import TrainingError
from tests.conftest import make_plan
from tests.pipeline_lib.launch_support import (
    make_config,
    plan_for,
    write_digits_dataset,
)


def numpy_function_mlp(schema, num_outputs, **params):
    """An MLP with one op XLA has no kernel for (a NumPy function): only a compiled step fails on it."""
    inputs = models.create_inputs(schema)
    def through_numpy(t):
        return tf.reshape(tf.numpy_function(lambda a: a, [t], tf.float32, stateful=False), tf.shape(t))

    x = keras.layers.Lambda(through_numpy, output_shape=lambda s: s)(inputs["numeric"])
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digits_dataset(str(tmp_path_factory.mktemp("digits")))


def test_digits_trains_to_095_with_xla(tmp_path, digits):
    config = make_config(str(tmp_path), label="target", model={"factory": "mlp", "params": {"hidden_units": [64]}},
                         strategy="default", jit_compile=True, per_replica_batch_size=32, base_learning_rate=0.005,
                         shuffle=True, deterministic=True, checkpoint_every_steps=300, log_every_steps=100)
    result = training.train(config, digits, plan_for(digits, config, steps=300), str(tmp_path / "run"))
    assert result.final_step == 300
    assert result.checkpoints[-1].metrics["eval_accuracy"] >= 0.95, result.checkpoints[-1].metrics


def test_xla_really_compiles_the_step(tmp_path, digits):
    factory = f"{__name__}:numpy_function_mlp"
    config = make_config(str(tmp_path), label="target", model={"factory": factory}, strategy="default", steps=2)
    plan = plan_for(digits, config, steps=2)
    assert training.train(config, digits, plan, str(tmp_path / "eager")).final_step == 2  # fine without XLA
    xla = make_config(str(tmp_path), label="target", model={"factory": factory}, strategy="default", steps=2,
                      jit_compile=True)
    with pytest.raises(TrainingError, match=r"train.jit_compile is on but XLA cannot compile .*PyFunc"):
        training.train(xla, digits, plan, str(tmp_path / "xla"))


def test_string_features_are_refused_before_training(tmp_path, tiny_manifest):
    config = make_config(str(tmp_path), strategy="default", jit_compile=True, steps=2)
    with pytest.raises(TrainingError, match=r"string feature\(s\) \['color'\]"):
        training.train(config, tiny_manifest, make_plan(tiny_manifest, steps=2), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
