"""A registered model's weights as the checkpoint `train.warm_start_uri` reads (the retrain flow's warm start)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from pipeline_lib.core import storage


def write_warm_start_checkpoint(keras_path: str, target_uri: str,
                                storage_options: dict[str, Any] | None = None) -> str:
    """Save a model's weights as a `tf.train.Checkpoint(model=...)`, the form `train.warm_start_uri` reads.

    Args:
        keras_path: the champion's `.keras` file.
        target_uri: a directory URI (under output_root, so every worker can read it).
        storage_options: fsspec options for the target.

    Returns:
        The checkpoint prefix to put in `train.warm_start_uri`.
    """
    import keras
    import tensorflow as tf

    from pipeline_lib.training import preprocessing  # noqa: F401  (registers the layers load_model needs)

    model = keras.saving.load_model(keras_path, compile=False)
    if storage.is_local(target_uri):
        directory = storage.local_path(target_uri)
        os.makedirs(directory, exist_ok=True)
        return tf.train.Checkpoint(model=model).write(os.path.join(directory, "weights"))
    fs, path = storage.get_fs(target_uri, storage_options)
    with tempfile.TemporaryDirectory(prefix="tfdag-warm-") as tmp:
        tf.train.Checkpoint(model=model).write(os.path.join(tmp, "weights"))
        storage.upload_tree(tmp, fs, path)
    return storage.join(target_uri, "weights")
