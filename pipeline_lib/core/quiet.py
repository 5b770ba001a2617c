"""Console noise of TensorFlow and its neighbours, off by default in every tfdag process (set before TensorFlow is
imported: `pipeline_lib` does it on import); `TFDAG_VERBOSE=1` (what `tfdag -v` sets) keeps all of it."""

from __future__ import annotations

import glob
import importlib
import logging
import os
import sys
import tempfile

VERBOSE_ENV = "TFDAG_VERBOSE"
# Python loggers whose INFO lines are start-up or bookkeeping chatter, not progress: TensorFlow's absl
# ("Sharding callback duration"), TensorFlow's ("Assets written to" on every SavedModel export), MLflow's
# system-metrics monitor, store migrations and input-example check, HTTP clients.
CHATTY_LOGGERS = ("absl", "tensorflow", "mlflow.system_metrics", "mlflow.store.db.utils", "mlflow.pyfunc",
                  "alembic", "httpx", "httpcore", "urllib3")


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def _has_nvidia_device() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/nvidiactl")


def quiet_tensorflow_env() -> None:
    """Before TensorFlow is imported: its C++ INFO and WARNING lines off (oneDNN, CPU features); on a machine with
    no NVIDIA device also its C++ errors, of which TensorFlow logs one there on every start (cuInit failed).
    Python errors are unaffected; an explicit TF_CPP_MIN_LOG_LEVEL wins; nothing changes when verbose."""
    if is_verbose():
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if _has_nvidia_device() else "3")


def quiet_python_loggers() -> None:
    """The chatty loggers at WARNING, and MLflow's artifact download bars off (tqdm, which Optuna brings, turns them
    on: a dozen console lines per logged model), unless verbose."""
    if is_verbose():
        return
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def import_tensorflow() -> None:
    """Import TensorFlow with the lines its shared libraries write straight to file descriptor 2 while loading
    (oneDNN, the CUDA stub; TF_CPP_MIN_LOG_LEVEL cannot reach them: they come before its logging starts) held
    back: shown if the import fails, and always when verbose. A no-op once TensorFlow is imported."""
    if "tensorflow" in sys.modules or is_verbose():
        importlib.import_module("tensorflow")
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            importlib.import_module("tensorflow")
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
