"""Champion and challenger on the MLflow model registry: the new-data check, the registration policy, aliases, tags."""

from __future__ import annotations

import glob as _glob
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import ConfigError, PipelineConfig, parse_config
from pipeline_lib.core import storage
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


class TrainCheck(BaseModel):
    """Whether the retrain flow trains, and the message when it does not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: bool
    message: str
    version: int | None = None  # the version whose data matches, when skipping


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


def check_for_new_data(fingerprint: SourceFingerprint, config_hash: str, champion: VersionInfo | None,
                       latest: VersionInfo | None, refused_run_id: str | None = None) -> TrainCheck:
    """Train when the data differs from the champion's (and from a refused challenger's of the same config).

    `fingerprint` is `data.sources.source_fingerprint(config.data)`: the source files' paths, sizes and mtimes or
    etags (a listing, no content read) with the conversion settings, the same value the manifest records.

    A challenger refused on exactly this data and config would be retrained to the same refusal every night,
    so that case is skipped as well (`latest` when it was registered, else `refused_run_id`, from
    `last_refused_run`); change the data or the config (or pass `force`) to try again.
    """
    short = fingerprint.sha256[:12]
    if champion is not None and champion.source_fingerprint == fingerprint.sha256:
        return TrainCheck(train=False, version=champion.version,
                          message=f"no new data since version {champion.version} (the champion; source "
                                  f"fingerprint {short}, {len(fingerprint.files)} file(s))")
    if (latest is not None and latest.blessed is False and latest.source_fingerprint == fingerprint.sha256
            and latest.tags.get(CONFIG_HASH_TAG) == config_hash):
        return TrainCheck(train=False, version=latest.version,
                          message=f"no new data since version {latest.version}, which was not promoted with this "
                                  f"same config (source fingerprint {short}); change the data or the "
                                  "config, or pass force=true, to train again")
    if refused_run_id is not None:
        return TrainCheck(train=False,
                          message=f"no new data since MLflow run {refused_run_id}, whose model was not blessed with "
                                  f"this same config (source fingerprint {short}); change the data or the config, "
                                  "or pass force=true, to train again")
    if champion is None:
        return TrainCheck(train=True, message="no champion yet: training the first model")
    seen = champion.source_fingerprint[:12] if champion.source_fingerprint else "untagged"
    return TrainCheck(train=True, message=f"new data: source fingerprint {short} differs from the "
                                          f"champion's (version {champion.version}, {seen})")


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


def apply_overrides(config: PipelineConfig, overrides: Mapping[str, Any], source: str = "overrides") -> PipelineConfig:
    """A copy of the config with dotted-key values replaced, validated again.

    Example: `{"train.steps": 1, "evaluation.gate.threshold": None}`.

    Raises:
        ConfigError: naming the key when it does not exist or its value is invalid.
    """
    data = config.revealed()  # re-validated in this process: a literal secret must stay usable
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{source} key {dotted!r}: {'.'.join(parts[:i + 1])} is not a config section; "
                    "use dotted keys of the pipeline YAML such as train.steps or evaluation.gate.threshold"
                )
            node = child
        node[parts[-1]] = value
    return parse_config(data, source=source)
