"""Champion and challenger on the MLflow model registry: the new-data check, the registration policy, aliases, tags."""

from __future__ import annotations

import glob as _glob
import logging
import os

from pipeline_lib.core.errors import TfdagError
from pipeline_lib.data.manifest import SourceFingerprint
from pipeline_lib.evaluation.report import GateDecision
from pipeline_lib.tracking.client import create_client
from pipeline_lib.tracking.records import (
    BLESSED_TAG,
    CHAMPION_ALIAS,
    CONFIG_HASH_TAG,
    FINGERPRINT_TAG,
    VersionInfo,
)
from pipeline_lib.tracking.run import BLESSED_RUN_TAG

logger = logging.getLogger(__name__)

# Model-version tags written by the retrain flow (FINGERPRINT_TAG, CONFIG_HASH_TAG, BLESSED_TAG: tracking.tracker).
CHALLENGER_SCORE_TAG = "tfdag.challenger_score"
CHAMPION_SCORE_TAG = "tfdag.champion_score"
COMPARED_WITH_TAG = "tfdag.compared_with_version"
GATE_METRIC_TAG = "tfdag.gate_metric"
REASON_TAG = "tfdag.decision_reason"


class RegistryError(TfdagError, RuntimeError):
    """The registry cannot be used as configured; the message names the value and the fix."""


def _version_info(mv) -> VersionInfo:
    return VersionInfo(name=mv.name, version=int(mv.version), run_id=mv.run_id or None,
                       tags=dict(mv.tags or {}), aliases=tuple(getattr(mv, "aliases", None) or ()))


def get_champion(tracking_uri: str, model_name: str, alias: str = CHAMPION_ALIAS) -> VersionInfo | None:
    """The version the alias points at, or None when the model or the alias does not exist yet."""
    from mlflow.exceptions import MlflowException

    client = create_client(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(model_name, alias)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise
    return _version_info(mv)


def get_version(tracking_uri: str, model_name: str, version: int | str) -> VersionInfo:
    """One registered version with its tags and aliases."""
    return _version_info(create_client(tracking_uri).get_model_version(model_name, str(version)))


def latest_version(tracking_uri: str, model_name: str) -> VersionInfo | None:
    """The newest registered version of the model, or None when it has none."""
    client = create_client(tracking_uri)
    versions = client.search_model_versions(f"name = '{model_name}'", max_results=1000)
    if not versions:
        return None
    newest = max(versions, key=lambda mv: int(mv.version))
    return get_version(tracking_uri, model_name, newest.version)


def last_refused_run(tracking_uri: str, experiment: str, fingerprint: SourceFingerprint,
                     config_hash: str) -> str | None:
    """The newest MLflow run that trained on exactly this data and config and was not blessed, or None.

    With `tracking.register: blessed` such a run registered nothing, so its run tags are the only record.
    """
    client = create_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs(
        [found.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
        filter_string=(f"tags.`{BLESSED_RUN_TAG}` = 'false' and tags.`{FINGERPRINT_TAG}` = '{fingerprint.sha256}' "
                       f"and tags.`{CONFIG_HASH_TAG}` = '{config_hash}'"))
    return runs[0].info.run_id if runs else None


def record_decision(tracking_uri: str, model_name: str, challenger_version: int | str, decision: GateDecision, *,
                    fingerprint: SourceFingerprint | None = None, config_hash: str | None = None,
                    alias: str | None = CHAMPION_ALIAS) -> VersionInfo:
    """Tag the challenger version with the gate's decision and both scores; move the alias when it is blessed.

    Args:
        alias: the alias a blessed version takes; None tags only (the training pipeline), the retrain flow
            promotes. A version that is not blessed never gets an alias.

    Returns:
        The challenger version as the registry now holds it.
    """
    client = create_client(tracking_uri)
    version = str(challenger_version)

    def score(value: float | None) -> str:
        return "none" if value is None else repr(float(value))

    tags = {
        BLESSED_TAG: "true" if decision.blessed else "false",
        CHALLENGER_SCORE_TAG: score(decision.value),
        CHAMPION_SCORE_TAG: score(decision.champion_value),
        GATE_METRIC_TAG: f"{decision.metric} ({decision.direction})",
        COMPARED_WITH_TAG: "none" if decision.champion_version is None else str(decision.champion_version),
        REASON_TAG: decision.reason[:5000],
    }
    if fingerprint is not None:
        tags[FINGERPRINT_TAG] = fingerprint.sha256
    if config_hash is not None:
        tags[CONFIG_HASH_TAG] = config_hash
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)
    if decision.blessed and alias:
        client.set_registered_model_alias(model_name, alias, version)
        logger.info("%s version %s is now %r: %s", model_name, version, alias, decision.reason)
    elif not decision.blessed:
        logger.info("%s version %s not blessed: %s", model_name, version, decision.reason)
    return get_version(tracking_uri, model_name, version)


def download_keras_model(tracking_uri: str, model_name: str, version: int | str, dst_dir: str) -> str:
    """Download a registered version's artifacts and return the path of its `.keras` file.

    Raises:
        RegistryError: when the version holds no `.keras` file (not logged by tfdag).
    """
    import mlflow

    client = create_client(tracking_uri)
    # The version's own download URI (a run or logged-model artifact URI) needs no process-wide registry URI.
    source = client.get_model_version_download_uri(model_name, str(version))
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=dst_dir, tracking_uri=tracking_uri)
    found = sorted(_glob.glob(os.path.join(local, "**", "*.keras"), recursive=True))
    if not found:
        raise RegistryError(
            f"registered model {model_name!r} version {version} ({source}) holds no .keras file; "
            "retrain compares against versions that tfdag registered (tracking.model_logging.log_and_register_model)"
        )
    return found[0]
