"""The model check's other side: load an exported model through the public loaders only, in a fresh interpreter.

`serving.validation` runs this file as a script from an empty working directory: `python -I fresh_load.py`, started
while the run still trains (`fresh_process.warm_up`), imports the loaders' modules, then reads its request from stdin
(`wait_for_request`). It imports only numpy, pandas, TensorFlow and MLflow, and refuses any import of tfdag's own
packages, so a model that needs tfdag to load or predict fails here. It writes one JSON result per loader: the
predictions, or the error with its traceback's tail.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import json
import os
import pickle
import sys
import traceback
from typing import Any

# tfdag's top-level packages: the editable install puts them on every interpreter's path, hence the finder.
TFDAG_PACKAGES = ("pipeline_lib", "tasks", "flows")
SAVED_MODEL_LOADER = "tf.saved_model.load"
PYFUNC_LOADER = "mlflow.pyfunc.load_model"


class WithoutTfdag(importlib.abc.MetaPathFinder):
    """Refuses tfdag's packages: what a machine without tfdag installed would answer."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        """Raises for tfdag's packages; None (the next finder decides) for every other module."""
        if name.partition(".")[0] in TFDAG_PACKAGES:
            raise ModuleNotFoundError(f"No module named {name!r} (the model check loads the model without tfdag)",
                                      name=name)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    return value.item() if hasattr(value, "item") else value


def _saved_model(saved_model_dir: str, tensors: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    signature = tf.saved_model.load(saved_model_dir).signatures["serving_default"]
    outputs = signature(**{name: tf.constant(value) for name, value in tensors.items()})
    result: dict[str, Any] = {"prediction": [_plain(v) for v in outputs["prediction"].numpy().reshape(-1)]}
    if "probabilities" in outputs:
        result["probabilities"] = outputs["probabilities"].numpy().astype(float).tolist()
    return result


def _pyfunc(model_uri: str, frame: Any, probability_columns: list[str]) -> dict[str, Any]:
    import mlflow  # `models:/` URIs resolve through MLFLOW_TRACKING_URI, set by the caller

    predicted = mlflow.pyfunc.load_model(model_uri).predict(frame)
    result: dict[str, Any] = {"prediction": [_plain(v) for v in predicted["prediction"].to_numpy()]}
    if probability_columns:
        result["probabilities"] = predicted[probability_columns].to_numpy(dtype=float).tolist()
    return result


def _attempt(fn, *args) -> dict[str, Any]:
    try:
        return {"ok": True, **fn(*args)}
    except BaseException as error:  # noqa: BLE001 - every failure is the check's finding
        lines = traceback.format_exception(error)
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": "".join(lines)[-4000:]}


def main(request_path: str) -> None:
    with open(request_path) as handle:
        request = json.load(handle)
    with open(request["inputs_path"], "rb") as handle:
        inputs = pickle.load(handle)
    results = {SAVED_MODEL_LOADER: _attempt(_saved_model, request["saved_model_dir"], inputs["tensors"])}
    if request.get("model_uri"):
        results[PYFUNC_LOADER] = _attempt(_pyfunc, request["model_uri"], inputs["frame"],
                                          request["probability_columns"])
    with open(request["output_path"], "w") as handle:
        json.dump(results, handle)


def _map_installed_packages() -> None:
    """What `mlflow.pyfunc.load_model` does first, made while the run still trains: it checks the model's
    requirements against this environment, and its first check maps every installed distribution to its modules (a
    scan of their files, about a second). The map is only a cache of what is installed, so the check's outcome is the
    same; a failure here is left to the check to meet."""
    import mlflow
    from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

    with contextlib.suppress(Exception):
        warn_dependency_requirement_mismatches([f"mlflow=={mlflow.__version__}"])


def wait_for_request() -> None:
    """Started ahead of the check: import what the loaders need, then read JSON lines from stdin. A line
    with `tracking_uri` alone opens that tracking store ahead (the run's, sent at the start); the line with `request`
    (`{"request": PATH, "tracking_uri": ..., "environment": {...}}`) runs the check in that environment, and the
    process ends as soon as its result is written (TensorFlow's and MLflow's teardown at exit is skipped: nothing of
    it is needed). At end of input it ends quietly (the caller went away or had nothing to check). The tracking URI
    and the environment come this way, not in a file: they may hold passwords."""
    sys.meta_path.insert(0, WithoutTfdag())
    # The imports with the cyclic collector off, then what they made out of its reach: what `core.startup.imports`
    # does in tfdag's processes, which this one cannot import.
    gc.disable()
    import mlflow.pyfunc  # imported while the run still trains, not when its model is checked
    import pandas  # noqa: F401
    import tensorflow  # noqa: F401

    gc.freeze()
    gc.enable()
    _map_installed_packages()

    for line in iter(sys.stdin.readline, ""):
        message = json.loads(line)
        if "request" not in message:
            with contextlib.suppress(Exception):  # only ahead of time: the check itself reports the store's errors
                mlflow.MlflowClient(message["tracking_uri"]).search_experiments(max_results=1)
            continue
        os.environ.clear()
        os.environ.update(message["environment"])  # the caller's of now: MLflow's settings may have changed since
        if message.get("tracking_uri"):  # where `models:/` resolves
            os.environ["MLFLOW_TRACKING_URI"] = message["tracking_uri"]
        main(message["request"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    wait_for_request()
