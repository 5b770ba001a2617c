"""A logged or registered model fetched from its tracking store by URI (`models:/name@alias`, `models:/name/3`,
`models:/m-…`, `runs:/<run id>/model`): its files, made local, and what it is."""

from __future__ import annotations

import dataclasses
import os
import re

from pipeline_lib.tracking.client import create_client, global_tracking_uri
from pipeline_lib.tracking.records import TrackingError

MODEL_URI_SCHEMES = ("models:/", "runs:/")
_ALIAS = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[^/]+)/?$")
_VERSION = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)/?$")


class ModelNotFoundError(TrackingError):
    """The URI names no model in the store; the message is the store's own."""


@dataclasses.dataclass(frozen=True)
class DownloadedModel:
    """A model's files under `local_dir`, with the registered name, version and alias the URI named (if any), the
    run that logged it and its logged model's id."""

    local_dir: str
    name: str | None
    version: int | None
    alias: str | None
    run_id: str | None
    model_id: str | None


def download_model(uri: str, tracking_uri: str, dst_dir: str) -> DownloadedModel:
    """Download the model `uri` names from the store at `tracking_uri` into `dst_dir`.

    Raises:
        ModelNotFoundError: the name, version, alias, run or model does not exist there.
    """
    from mlflow import artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    client = create_client(tracking_uri)
    name = alias = None
    version: int | None = None
    try:
        if match := _ALIAS.match(uri):
            name, alias = match["name"], match["alias"]
            version = int(client.get_model_version_by_alias(name, alias).version)
        elif match := _VERSION.match(uri):
            name, version = match["name"], int(match["version"])
            client.get_model_version(name, str(version))
        # MLflow resolves a models:/ URI with the process-wide registry, whatever download_artifacts is given.
        with global_tracking_uri(tracking_uri):
            local = artifacts.download_artifacts(artifact_uri=uri, dst_path=dst_dir)
    except MlflowException as error:
        raise ModelNotFoundError(error.message) from None
    meta_path = os.path.join(local, "MLmodel")
    meta = Model.load(meta_path) if os.path.exists(meta_path) else None
    return DownloadedModel(local_dir=local, name=name, version=version, alias=alias,
                           run_id=getattr(meta, "run_id", None), model_id=getattr(meta, "model_id", None))
