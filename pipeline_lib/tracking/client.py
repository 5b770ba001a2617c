"""The MLflow client of a tracking URI, the process-wide URIs model logging needs, and tags without credentials."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline_lib.core.secrets import is_secret_name, mask_url_passwords

logger = logging.getLogger(__name__)

# MLflow's own limit on a tag value (mlflow.utils.validation).
MAX_TAG_VALUE = 8000
# MLflow's HTTP defaults (7 retries, backoff factor 2, 120 s a request) keep a run waiting minutes on a server that
# is not there; these give up after 3 tries of at most 10 s each with short, jittered backoffs, so a stage fails
# (and its task may retry) instead of hanging. A value the user set in the environment wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def bound_http_retries() -> None:
    """Set MLflow's HTTP retry and timeout variables to `HTTP_DEFAULTS` where the environment does not set them."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def create_client(tracking_uri: str):
    """An MlflowClient on the store (also the registry); a sqlite store's directory is created first."""
    from mlflow import MlflowClient

    if tracking_uri.startswith("sqlite:///"):
        directory = os.path.dirname(tracking_uri.removeprefix("sqlite:///"))
        if directory:
            os.makedirs(directory, exist_ok=True)
    bound_http_retries()
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


@contextlib.contextmanager
def masked_run_links(tracking_uri: str) -> Iterator[None]:
    """Within it, MLflow prints no run link when the tracking URI holds a password: its client writes the URI as it
    is (`🏃 View run ... at: http://user:password@host/...`) to stdout when a run ends. tfdag's own link
    (`run.run_ui_url`) masks the password."""
    name = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    if mask_url_passwords(tracking_uri) == tracking_uri:
        yield
        return
    previous = os.environ.get(name)
    os.environ[name] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def global_tracking_uri(tracking_uri: str) -> Iterator[None]:
    """MLflow's model logging reads the process-wide URIs; set them for the call only."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    # The raw module values, not get_*_uri(): "unset" must come back as unset, or the registry would stay
    # pinned to the default store instead of following each client's tracking URI.
    previous_tracking, previous_registry = tracking_utils._tracking_uri, registry_utils._registry_uri
    # set_tracking_uri also exports MLFLOW_TRACKING_URI (and the registry variable) to the environment, where
    # it would outlive this call and redirect every later pipeline in the process: restore those too.
    saved_env = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri = previous_tracking
        registry_utils._registry_uri = previous_registry
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def clean_tags(tags: Mapping[str, Any] | None) -> dict[str, str]:
    """The tags as strings within MLflow's length limit, without names that look like credentials and with the
    password of any URL masked."""
    cleaned = {}
    for name, value in (tags or {}).items():
        if is_secret_name(name):
            logger.warning("tag %s looks like a credential and is not logged", name)
            continue
        cleaned[name] = mask_url_passwords(str(value))[:MAX_TAG_VALUE]
    return cleaned
