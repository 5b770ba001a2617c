"""tfdag's library layer: every pipeline stage as a plain function (no Prefect import)."""

import os

from pipeline_lib.core.quiet import quiet_tensorflow_env

__version__ = "0.1.0"

# Every tfdag process imports this package before TensorFlow: its C++ start-up chatter is off unless verbose.
quiet_tensorflow_env()
# ... and before MLflow, whose usage telemetry is off unless the environment says otherwise: a run sends nothing
# off the machine but what its config names (the model check's process and the workers inherit the setting).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
