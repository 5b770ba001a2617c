"""Champion and challenger on the MLflow model registry: the new-data check, the promotion rule, aliases, tags."""

from __future__ import annotations

import glob as _glob
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import (
    ConfigError,
    Direction,
    GateConfig,
    PipelineConfig,
    metric_direction,
    parse_config,
)
from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError
from pipeline_lib.data.manifest import SourceFingerprint
from pipeline_lib.evaluation.gate import reaches_threshold, threshold_text
from pipeline_lib.tracking.client import create_client

logger = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
# Model-version tags written by the retrain flow.
FINGERPRINT_TAG = "tfdag.source_fingerprint"
CONFIG_HASH_TAG = "tfdag.config_hash"
BLESSED_TAG = "blessed"
CHALLENGER_SCORE_TAG = "tfdag.challenger_score"
CHAMPION_SCORE_TAG = "tfdag.champion_score"
COMPARED_WITH_TAG = "tfdag.compared_with_version"
GATE_METRIC_TAG = "tfdag.gate_metric"
REASON_TAG = "tfdag.decision_reason"
_TOLERANCE = 1e-9


class RegistryError(TfdagError, RuntimeError):
    """The registry cannot be used as configured; the message names the value and the fix."""


class VersionInfo(BaseModel):
    """A registered model version with the tags the retrain flow reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: int
    run_id: str | None
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()

    @property
    def source_fingerprint(self) -> str | None:
        return self.tags.get(FINGERPRINT_TAG)

    @property
    def blessed(self) -> bool | None:
        value = self.tags.get(BLESSED_TAG)
        return None if value is None else value.lower() == "true"


class Decision(BaseModel):
    """Whether the challenger replaces the champion, with both scores and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blessed: bool
    metric: str
    direction: str  # "max" or "min"
    challenger_score: float | None
    champion_score: float | None
    champion_version: int | None
    min_improvement: float
    reason: str


def _is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def decide(challenger_score: float | None, champion_score: float | None, gate: GateConfig,
           min_improvement: float, champion_version: int | None = None) -> Decision:
    """The promotion rule.

    The challenger is blessed when it has a score, reaches `gate.threshold` (when set) and, when there is a
    champion, beats it by at least `min_improvement` in the metric's direction (strictly, when the margin is 0:
    a tie keeps the champion). With no champion the first model that passes the threshold is blessed.

    Args:
        challenger_score: the challenger's `gate.metric` on the new eval split.
        champion_score: the champion's on the same split; None when there is no champion.
        gate: `evaluation.gate` (metric, direction, threshold).
        min_improvement: `evaluation.effective_min_improvement`.
        champion_version: the champion's version number, for the reason text.

    Returns:
        The Decision.
    """
    direction = metric_direction(gate.metric, gate.direction)
    metric = gate.metric

    def verdict(blessed: bool, reason: str) -> Decision:
        return Decision(blessed=blessed, metric=metric, direction=direction.value,
                        challenger_score=challenger_score, champion_score=champion_score,
                        champion_version=champion_version, min_improvement=min_improvement, reason=reason)

    if not _is_number(challenger_score):
        return verdict(False, f"the challenger has no {metric} score ({challenger_score})")
    assert challenger_score is not None
    if gate.threshold is not None and not reaches_threshold(challenger_score, gate.threshold, direction):
        return verdict(False, f"challenger {metric} {challenger_score:.4f} misses evaluation.gate.threshold "
                              f"({threshold_text(gate.threshold, direction)})")
    if champion_version is None and champion_score is None:
        return verdict(True, f"no champion yet; the first model ({metric} {challenger_score:.4f}) is promoted")
    if not _is_number(champion_score):
        return verdict(True, f"champion v{champion_version} has no {metric} score ({champion_score}) on the new "
                             f"eval split; challenger {metric} {challenger_score:.4f} is promoted")
    assert champion_score is not None
    improvement = challenger_score - champion_score if direction == Direction.MAX else \
        champion_score - challenger_score
    # The tolerance keeps 0.95 - 0.90 (0.04999…) a win by a 0.05 margin.
    better = improvement > _TOLERANCE if min_improvement == 0 else improvement >= min_improvement - _TOLERANCE
    word = "higher" if direction == Direction.MAX else "lower"
    comparison = (f"challenger {metric} {challenger_score:.4f} vs champion v{champion_version} "
                  f"{champion_score:.4f} ({improvement:+.4f} in the {word}-is-better direction; "
                  f"needs {'> 0' if min_improvement == 0 else f'≥ {min_improvement:g}'})")
    return verdict(better, ("promoted: " if better else "kept the champion: ") + comparison)


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


def check_for_new_data(fingerprint: SourceFingerprint, config_hash: str, champion: VersionInfo | None,
                       latest: VersionInfo | None) -> TrainCheck:
    """Train when the data differs from the champion's (and from a refused challenger's of the same config).

    `fingerprint` is `data.sources.source_fingerprint(config.data)`: the source files' paths, sizes and mtimes or
    etags (a listing, no content read) with the conversion settings, the same value the manifest records.

    A challenger refused on exactly this data and config would be retrained to the same refusal every night,
    so that case is skipped as well; change the data or the config (or pass `force`) to try again.
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
    if champion is None:
        return TrainCheck(train=True, message="no champion yet: training the first model")
    seen = champion.source_fingerprint[:12] if champion.source_fingerprint else "untagged"
    return TrainCheck(train=True, message=f"new data: source fingerprint {short} differs from the "
                                          f"champion's (version {champion.version}, {seen})")


def record_decision(tracking_uri: str, model_name: str, challenger_version: int | str, decision: Decision, *,
                    fingerprint: SourceFingerprint | None = None, config_hash: str | None = None,
                    alias: str = CHAMPION_ALIAS) -> VersionInfo:
    """Tag the challenger version with the verdict and both scores; move the alias when it is blessed.

    Returns:
        The challenger version as the registry now holds it.
    """
    client = create_client(tracking_uri)
    version = str(challenger_version)

    def score(value: float | None) -> str:
        return "none" if value is None else repr(float(value))

    tags = {
        BLESSED_TAG: "true" if decision.blessed else "false",
        CHALLENGER_SCORE_TAG: score(decision.challenger_score),
        CHAMPION_SCORE_TAG: score(decision.champion_score),
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
    if decision.blessed:
        client.set_registered_model_alias(model_name, alias, version)
        logger.info("%s version %s is now %r: %s", model_name, version, alias, decision.reason)
    else:
        logger.info("%s version %s not promoted: %s", model_name, version, decision.reason)
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
    data = config.model_dump(mode="json")
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
