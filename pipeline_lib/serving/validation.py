"""The model check before registration: the export, loaded in a fresh process through the public loaders only,
must predict what the trained model predicts in this one.

Like TFX's InfraValidator: `validate_model` runs `fresh_load.py` in a new interpreter (`python -I`, an empty
working directory, tfdag's packages refused), which loads the SavedModel with `tf.saved_model.load` and, when the
model was logged, the MLflow model with `mlflow.pyfunc.load_model`, and predicts raw rows (missing cells
included). Here the `.keras` model predicts the same rows; probabilities (or regression values) must agree within
`tolerance` and predicted labels exactly. One process checks both loaders: it pays TensorFlow's and MLflow's
imports once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import pandas as pd
import tensorflow as tf
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import Task
from pipeline_lib.core import storage
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.data.manifest import Schema
from pipeline_lib.serving import fresh_load, fresh_process, tfdag_scoring
from pipeline_lib.serving.signatures import (
    input_names,
    label_values,
    raw_to_model_inputs,
    serving_spec,
)
from pipeline_lib.training import models  # noqa: F401 - registers the custom layers model.keras is saved with

logger = logging.getLogger(__name__)

SAVED_MODEL_LOADER = fresh_load.SAVED_MODEL_LOADER
PYFUNC_LOADER = fresh_load.PYFUNC_LOADER
DEFAULT_TOLERANCE = 1e-5
DEFAULT_NUM_ROWS = 64
DEFAULT_TIMEOUT_S = 300.0
# Called in order with the local SavedModel (the export itself when it is local) just before the fresh process
# loads it; empty unless a caller adds one. Tests break the export here (`pipeline_lib.testing.export_faults`).
before_check_fns: list[Callable[[str], None]] = []

_FIX = {
    SAVED_MODEL_LOADER: "the SavedModel must load with TensorFlow alone: re-export it (the run's consolidation "
                        "step) and compare its files with the sha256s in export_manifest.json",
    PYFUNC_LOADER: "the logged model must load with MLflow alone: everything it imports ships in its code_paths "
                   "(tfdag_scoring.py, tfdag_instants.py) and its requirements; load it by hand with mlflow.pyfunc.load_model to see "
                   "the whole traceback",
}
_MISMATCH_FIX = ("the export does not compute what the trained model does: compare "
                 "serving.signatures.raw_to_model_inputs with the training inputs (input_pipeline)")


class LoaderCheck(BaseModel):
    """One loader's verdict: it loaded and predicted the rows as the trained model does, or why not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loader: str  # SAVED_MODEL_LOADER or PYFUNC_LOADER
    uri: str  # what it loaded
    passed: bool
    error: str | None = None  # the loader's error, or the mismatch
    fix: str | None = None
    max_abs_diff: float | None = None  # over the probabilities (classification) or the predictions (regression)
    labels_differ: int = 0  # rows whose predicted label differs (ties within the tolerance excepted)
    traceback: str | None = None

    def describe(self) -> str:
        if self.passed:
            return f"{self.loader} passed (max |Δ| {self.max_abs_diff:.2g})"
        return f"{self.loader}({self.uri!r}) in a fresh process without tfdag: {self.error}; fix: {self.fix}"


class ModelValidation(BaseModel):
    """The model check's result: every loader's check, on how many rows, and one reason to show."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    passed: bool
    reason: str
    checks: tuple[LoaderCheck, ...]
    skipped: tuple[str, ...] = ()  # loaders not checked, each with why
    rows: int
    rows_with_missing: int
    tolerance: float
    max_abs_diff: float | None
    seconds: float

    def check(self, loader: str) -> LoaderCheck | None:
        return next((c for c in self.checks if c.loader == loader), None)

    def to_markdown(self) -> str:
        rows = (f"{self.rows} eval rows ({self.rows_with_missing} with missing cells), tolerance {self.tolerance:g}, "
                f"{self.seconds:.1f} s")
        lines = [f"# Model check: {'passed' if self.passed else 'FAILED'}", "", self.reason, "", rows, "",
                 "| loader | loaded | result |", "|---|---|---|"]
        for check in self.checks:
            result = (f"max abs diff {check.max_abs_diff:.2g}, labels equal" if check.passed
                      else f"**failed**: {check.error} — fix: {check.fix}")
            lines.append(f"| `{check.loader}` | `{check.uri}` | {result.replace('|', '/')} |")
        lines += [f"| `{s.split(':')[0]}` | — | skipped: {s.partition(': ')[2]} |" for s in self.skipped]
        return "\n".join(lines) + "\n"


def reference_outputs(model: keras.Model, schema: Schema, task: Task,
                      tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trained model's own answer on the rows (`tensors` by column name): `prediction` in the label's values,
    and `probabilities` for classification, computed here on the CPU (the fresh process has no GPU)."""
    names = input_names(schema)
    columns = {names[name]: tf.constant(value) for name, value in tensors.items()}
    with tf.device("/CPU:0"):
        logits = np.asarray(model(raw_to_model_inputs(schema, columns), training=False), np.float64)
    values = label_values(schema, task)
    if values is None:
        return {"prediction": logits.reshape(-1)}
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    return {"prediction": np.asarray([values[i] for i in probabilities.argmax(axis=1)], dtype=object),
            "probabilities": probabilities}


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, Any], tolerance: float) -> tuple[float, int]:
    """(max |Δ|, rows whose label differs) between the trained model's outputs and a loader's.

    The values compared are the probabilities (classification) or the predictions (regression); a NaN equals a
    NaN. A label may differ only where the trained model's two best classes are within `tolerance`: a tie that
    float rounding decides either way.
    """
    if "probabilities" in reference:
        expected = np.asarray(reference["probabilities"], np.float64)
        actual = np.asarray(got.get("probabilities"), np.float64)
    else:
        expected = np.asarray(reference["prediction"], np.float64)
        actual = np.asarray(got["prediction"], np.float64)
    if actual.shape != expected.shape:
        return math.inf, len(expected)
    diff = np.where(np.isnan(expected) & np.isnan(actual), 0.0, np.abs(expected - actual))
    max_diff = float(np.nan_to_num(diff, nan=math.inf).max()) if diff.size else 0.0
    if "probabilities" not in reference:
        return max_diff, 0
    top_two = np.sort(expected, axis=1)[:, -2:] if expected.shape[1] > 1 else np.zeros((len(expected), 2))
    decided = (top_two[:, 1] - top_two[:, 0]) > tolerance
    differ = np.asarray([str(a) != str(b) for a, b in zip(reference["prediction"], got["prediction"])])
    return max_diff, int((differ & decided).sum())


def _local_copy(uri: str, storage_options: Mapping[str, Any] | None, stack: contextlib.ExitStack) -> str:
    """A local path of a file or directory (an fsspec URI is downloaded to a temporary directory first)."""
    if storage.is_local(uri):
        return storage.local_path(uri)
    local = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="tfdag-check-")),
                         os.path.basename(uri.rstrip("/")))
    fs, path = storage.get_fs(uri, dict(storage_options or {}))
    if fs.isdir(path):
        fs.get(path.rstrip("/") + "/", local, recursive=True)
    else:
        fs.get(path, local)
    return local


@contextlib.contextmanager
def fresh_process_results(saved_model_dir: str, model_uri: str | None, tracking_uri: str | None,
                          frame: pd.DataFrame, tensors: Mapping[str, np.ndarray], probability_columns: Sequence[str],
                          timeout_s: float) -> Iterator[Callable[[], dict[str, dict[str, Any]]]]:
    """`fresh_load.py` on these rows in a new interpreter (the one `warm_up` started, when there is one), sent on
    entry: the block goes on while it loads, and calls what it gets for the result per loader.

    Raises:
        RuntimeError: (from the call) the process did not write a result (it crashed or ran past `timeout_s`).
    """
    with tempfile.TemporaryDirectory(prefix="tfdag-model-check-") as work:
        request = {"saved_model_dir": os.path.abspath(saved_model_dir), "model_uri": model_uri,
                   "probability_columns": list(probability_columns),
                   "inputs_path": os.path.join(work, "inputs.pkl"), "output_path": os.path.join(work, "result.json")}
        with open(request["inputs_path"], "wb") as handle:
            pickle.dump({"frame": frame, "tensors": dict(tensors)}, handle)
        with open(os.path.join(work, "request.json"), "w") as handle:
            json.dump(request, handle)
        process = fresh_process.take_process()
        process.send(os.path.join(work, "request.json"), tracking_uri)

        def results() -> dict[str, dict[str, Any]]:
            output = process.finish(timeout_s)
            if not os.path.exists(request["output_path"]):
                raise RuntimeError(f"the fresh process ended without a result: {output}")
            with open(request["output_path"]) as handle:
                return json.load(handle)

        try:
            yield results
        finally:
            process.close()  # a block that raised before asking: the process ends before its files go


def _rows_with_missing(frame: pd.DataFrame) -> int:
    def missing(cell: Any) -> bool:
        if isinstance(cell, list | tuple | np.ndarray):
            return any(missing(c) for c in cell)
        return cell is None or cell is pd.NaT or (isinstance(cell, float) and math.isnan(cell))

    return int(frame.map(missing).any(axis=1).sum()) if len(frame) else 0


def _loader_check(loader: str, uri: str, result: Mapping[str, Any], reference: Mapping[str, np.ndarray],
                  tolerance: float) -> LoaderCheck:
    if not result.get("ok"):
        # Masked: an MLflow error may quote the tracking URI, and the text goes to artifacts.
        trace = result.get("traceback")
        return LoaderCheck(loader=loader, uri=uri, passed=False,
                           error=mask_url_passwords(result.get("error", "no result")), fix=_FIX[loader],
                           traceback=mask_url_passwords(trace) if trace else None)
    max_diff, labels_differ = compare(reference, result, tolerance)
    if max_diff <= tolerance and not labels_differ:
        return LoaderCheck(loader=loader, uri=uri, passed=True, max_abs_diff=max_diff)
    what = "probabilities" if "probabilities" in reference else "predictions"
    error = (f"its {what} differ from the trained model's by up to {max_diff:.3g} (tolerance {tolerance:g})"
             + (f" and its label differs on {labels_differ} row(s)" if labels_differ else ""))
    return LoaderCheck(loader=loader, uri=uri, passed=False, error=error, fix=_MISMATCH_FIX, max_abs_diff=max_diff,
                       labels_differ=labels_differ)


def validate_model(saved_model_dir: str, keras_path: str, logged_model_uri: str | None, tracking_uri: str | None,
                   sample: pd.DataFrame, schema: Schema, task: Task, *,
                   storage_options: Mapping[str, Any] | None = None, tolerance: float = DEFAULT_TOLERANCE,
                   timeout_s: float = DEFAULT_TIMEOUT_S, pyfunc_skipped_because: str | None = None
                   ) -> ModelValidation:
    """Load the export in a fresh process through the public loaders and compare its predictions with the trained
    model's on `sample`.

    Args:
        saved_model_dir: the export's SavedModel (local path or fsspec URI).
        keras_path: the export's `model.keras`: the reference.
        logged_model_uri: the MLflow model (`models:/m-…`) to check too; None skips that loader.
        tracking_uri: where `logged_model_uri` resolves.
        sample: raw rows of the table (`serving.rows.raw_rows`), missing cells as NaN / None.
        schema: the data's feature schema (the manifest's).
        task: the model's task.
        pyfunc_skipped_because: why there is no logged model, shown in the result.

    Returns:
        The ModelValidation; a loader that fails, or disagrees, makes it not passed. Nothing is raised for the
        model's faults: the caller decides what a failed check means.
    """
    started = time.monotonic()
    values = label_values(schema, task)
    probability_columns = [tfdag_scoring.probability_column(v) for v in values] if values is not None else []
    tensors = tfdag_scoring.to_tensors(serving_spec(schema, task)["columns"], sample)
    with contextlib.ExitStack() as stack:
        local_saved = _local_copy(saved_model_dir, storage_options, stack)
        for fn in before_check_fns:
            fn(local_saved)
        names = input_names(schema)
        by_input = {names[name]: value for name, value in tensors.items()}
        uris = {SAVED_MODEL_LOADER: saved_model_dir, PYFUNC_LOADER: logged_model_uri or ""}
        fresh_results = stack.enter_context(fresh_process_results(
            local_saved, logged_model_uri, tracking_uri, sample, by_input, probability_columns, timeout_s))
        # The trained model's answer, computed while the fresh process loads the export.
        model = keras.saving.load_model(_local_copy(keras_path, storage_options, stack), compile=False)
        reference = reference_outputs(model, schema, task, tensors)
        try:
            results = fresh_results()
        except RuntimeError as error:
            results = {loader: {"ok": False, "error": str(error)} for loader in uris if uris[loader]}
    checks = tuple(_loader_check(loader, uris[loader], result, reference, tolerance)
                   for loader, result in results.items())
    skipped = () if logged_model_uri else (
        f"{PYFUNC_LOADER}: {pyfunc_skipped_because or 'no logged MLflow model to load'}",)
    passed = all(c.passed for c in checks)
    diffs = [c.max_abs_diff for c in checks if c.max_abs_diff is not None]
    rows_missing = _rows_with_missing(sample)
    if passed:
        reason = (f"{' and '.join(c.loader for c in checks)} in a fresh process without tfdag reproduce the trained "
                  f"model on {len(sample)} eval rows ({rows_missing} with missing cells): max |Δ| "
                  f"{max(diffs, default=0.0):.2g} ≤ {tolerance:g}, labels equal"
                  + "".join(f"; {s.replace(': ', ' skipped: ', 1)}" for s in skipped))
    else:
        reason = "the model check failed: " + "; ".join(c.describe() for c in checks if not c.passed)
    validation = ModelValidation(passed=passed, reason=reason, checks=checks, skipped=skipped, rows=len(sample),
                                 rows_with_missing=rows_missing, tolerance=tolerance,
                                 max_abs_diff=max(diffs, default=None), seconds=time.monotonic() - started)
    logger.debug("model check: %s", reason)
    return validation
