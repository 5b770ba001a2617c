"""One worker of the multi-worker baseline: Keras 2 (`tf_keras`) `model.fit` under MultiWorkerMirroredStrategy.

Run as a script with TF_USE_LEGACY_KERAS=1 and a TF_CONFIG by `bench_training`: the same MLP as tfdag's `mlp`
(the numeric inputs, Dense layers, logits), the same TFRecords read by the same `create_dataset`, at the same
global batch and steps per execution; every worker prints `RESULT {times}` with the clock after each execution.
What Ray Train and Kubeflow's TFJob fall back to for multi-worker Keras today.
"""

from __future__ import annotations

import json
import os
import sys
import time

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run with TF_USE_LEGACY_KERAS=1 (tf.keras is then tf_keras)"

import tensorflow as tf  # after the check: the variable decides which Keras tf.keras is

from pipeline_lib.data.manifest import Manifest
from pipeline_lib.training import input_pipeline


def main() -> int:
    args = json.loads(sys.argv[1])
    manifest = Manifest.model_validate_json(args["manifest"])
    names = [spec.name for spec in manifest.feature_schema.features]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras = tf.keras
    assert keras.__name__.startswith("tf_keras"), f"tf.keras is {keras.__name__}, not tf_keras"

    def features(inputs, labels):
        return inputs["numeric"], labels  # the float features side by side, as tfdag's MLP takes them

    # The global batch, as Keras 2 wants it: fit shards the data between the workers (auto_shard_policy DATA,
    # as tfdag's plan does with policy "data") and splits each batch between the replicas.
    dataset = input_pipeline.create_dataset(manifest, "train", args["global_batch"], shuffle=True, seed=42,
                                            drop_remainder=True, repeat=True).map(features)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        inputs = keras.Input((len(names),))
        x = inputs
        for units in args["hidden"]:
            x = keras.layers.Dense(units, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(args["num_classes"])(x))
        model.compile(optimizer=keras.optimizers.Adam(args["learning_rate"]),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=args["steps_per_execution"])
    times: dict[int, tuple[float, float]] = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            times[batch_index + 1] = (time.perf_counter(), time.process_time())

    model.fit(dataset, epochs=1, steps_per_epoch=args["steps"], verbose=0, callbacks=[Clock()])
    print("RESULT", json.dumps({"times": times, "global_batch": args["global_batch"]}), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # TensorFlow's collective threads can hang interpreter shutdown
