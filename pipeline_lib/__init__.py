"""tfdag's library layer: every pipeline stage as a plain function (no Prefect import)."""

from pipeline_lib.core.quiet import quiet_tensorflow_env

__version__ = "0.1.0"

# Every tfdag process imports this package before TensorFlow: its C++ start-up chatter is off unless verbose.
quiet_tensorflow_env()
