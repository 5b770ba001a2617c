"""The model a batch-scoring run names, found and made local: an export directory or an MLflow model URI."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.core import storage
from pipeline_lib.core.errors import UserError
from pipeline_lib.core.secrets import mask_url_passwords
from pipeline_lib.evaluation.consolidation import (
    EXPORT_MANIFEST_NAME,
    SAVED_MODEL_NAME,
    verify_export,
)
from pipeline_lib.tracking.model_download import (
    MODEL_URI_SCHEMES,
    ModelNotFoundError,
    download_model,
)

logger = logging.getLogger(__name__)

MLFLOW_SCHEMES = MODEL_URI_SCHEMES
# Where the logged pyfunc keeps the SavedModel (tracking.model_logging logs it as the artifact `saved_model`).
PYFUNC_SAVED_MODEL = os.path.join("artifacts", "saved_model")


class PredictionError(UserError, ValueError):
    """The model or the table cannot be scored; the message names the value, where it came from and the fix."""


class ResolvedModel(BaseModel):
    """Which model scored the table: what the output's metadata records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str  # as given (a URL's password masked)
    source: str  # "export" or "mlflow"
    name: str | None = None  # the registered model
    version: int | None = None
    alias: str | None = None
    run_id: str | None = None
    model_id: str | None = None  # MLflow's logged model (m-…)
    details: dict[str, Any] = {}  # an export's checkpoint step, data fingerprint and creation time

    def describe(self) -> str:
        """`models:/wine@champion (wine version 3)`, or the export directory."""
        if self.name and self.version is not None:
            return f"{self.uri} ({self.name} version {self.version})"
        return self.uri


def is_mlflow_uri(uri: str) -> bool:
    return uri.startswith(MLFLOW_SCHEMES)


@contextlib.contextmanager
def open_model(uri: str, *, tracking_uri: str | None = None,
               storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[ResolvedModel, str]]:
    """The model `uri` names and its SavedModel as a local directory (downloaded, then removed on exit).

    Args:
        uri: an export directory (local or fsspec: `saved_model/` and `export_manifest.json`, checked against the
            manifest's sha256s), or an MLflow URI (`models:/name@alias`, `models:/name/3`, `models:/m-…`,
            `runs:/<run id>/model`).
        tracking_uri: the MLflow store of an MLflow URI.
        storage_options: fsspec options of an export directory.

    Raises:
        PredictionError: the directory is no complete export, or the MLflow URI names nothing in the store.
    """
    with tempfile.TemporaryDirectory(prefix="tfdag-predict-model-") as work_dir:
        if is_mlflow_uri(uri):
            yield _mlflow_model(uri, tracking_uri, work_dir)
        else:
            yield _export_model(uri, dict(storage_options or {}), work_dir)


def _export_model(uri: str, storage_options: dict[str, Any], work_dir: str) -> tuple[ResolvedModel, str]:
    fs, root = storage.get_fs(uri, storage_options)
    if not fs.exists(storage.join(root, EXPORT_MANIFEST_NAME)):
        raise PredictionError(
            f"model {uri!r} is neither an export directory (it has no {EXPORT_MANIFEST_NAME}) nor an MLflow model "
            "URI; name the export_dir of a run (with saved_model/ and export_manifest.json) or models:/NAME@ALIAS, "
            "models:/NAME/VERSION or runs:/RUN_ID/model")
    problems = verify_export(uri, storage_options)
    if problems:
        raise PredictionError(f"model {uri!r} is not an intact export: {'; '.join(problems)}; export it again "
                              "(tfdag run) or name another model")
    manifest = json.loads(fs.cat_file(storage.join(root, EXPORT_MANIFEST_NAME)))
    saved_name = manifest.get("saved_model_dir", SAVED_MODEL_NAME)
    if storage.is_local(uri):
        local = os.path.join(storage.local_path(uri), saved_name)
    else:  # TensorFlow loads local files: the SavedModel comes down first
        local = os.path.join(work_dir, saved_name)
        fs.get(storage.join(root, saved_name).rstrip("/") + "/", local, recursive=True)
    details = {"checkpoint_step": manifest.get("checkpoint", {}).get("step"),
               "data_fingerprint": manifest.get("data_fingerprint"), "created_at": manifest.get("created_at")}
    return ResolvedModel(uri=mask_url_passwords(uri), source="export", details=details), local


def _mlflow_model(uri: str, tracking_uri: str | None, work_dir: str) -> tuple[ResolvedModel, str]:
    if not tracking_uri:
        raise PredictionError(f"model {uri!r} is an MLflow URI but no MLflow store is given; pass --tracking-uri "
                              "(tracking_uri) or set MLFLOW_TRACKING_URI")
    shown = mask_url_passwords(uri)
    store = mask_url_passwords(tracking_uri)
    try:
        model = download_model(uri, tracking_uri, work_dir)
    except ModelNotFoundError as error:
        raise PredictionError(f"model {shown!r} is not in the MLflow store {store} ({error}); check the "
                              "name, version or alias (the MLflow UI lists them) and --tracking-uri") from None
    saved_model_dir = os.path.join(model.local_dir, PYFUNC_SAVED_MODEL)
    if not os.path.isdir(saved_model_dir):
        raise PredictionError(f"model {shown!r} in {store} holds no {PYFUNC_SAVED_MODEL}: it was not logged by tfdag "
                              "(tracking.model_logging); name a model a tfdag run registered")
    logger.info("predict | model %s downloaded from %s", shown, store)
    return ResolvedModel(uri=shown, source="mlflow", name=model.name, version=model.version, alias=model.alias,
                         run_id=model.run_id, model_id=model.model_id), saved_model_dir
