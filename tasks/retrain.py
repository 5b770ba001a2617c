"""The champion's thin Prefect tasks: source fingerprint, champion, last attempt, warm start, champion score,
promotion."""

from __future__ import annotations

import tempfile

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.data.manifest import Manifest, SourceFingerprint
from pipeline_lib.data.sources import source_fingerprint
from pipeline_lib.evaluation import metrics as evaluation
from pipeline_lib.evaluation.report import EvalReport, GateDecision
from pipeline_lib.tracking.tracker import VersionInfo, open_tracker
from pipeline_lib.training.warm_start import write_warm_start_checkpoint
from tasks.retry import transient_retries


@task(cache_policy=NO_CACHE, name="fingerprint_source", **transient_retries())
def fingerprint_source(config: PipelineConfig) -> SourceFingerprint:
    """A listing (paths, sizes, mtimes or etags) and the conversion settings; an object store listing can fail
    transiently: retried."""
    fingerprint = source_fingerprint(config.data)
    get_run_logger().info("source %s: %d file(s), %d bytes, fingerprint %s", config.data.source,
                          len(fingerprint.files), sum(f.size for f in fingerprint.files), fingerprint.sha256[:12])
    return fingerprint


@task(cache_policy=NO_CACHE, name="find_champion", **transient_retries())
def find_champion(config: PipelineConfig) -> VersionInfo | None:
    name = config.tracking.registered_model
    assert name is not None
    return open_tracker(config).get_champion(name)


@task(cache_policy=NO_CACHE, name="find_last_attempt", **transient_retries())
def find_last_attempt(config: PipelineConfig, fingerprint: SourceFingerprint,
                      config_hash: str) -> tuple[VersionInfo | None, str | None]:
    """The newest registered version, and the newest run on this data and config that was not blessed."""
    name = config.tracking.registered_model
    assert name is not None
    tracker = open_tracker(config)
    return tracker.latest_version(name), tracker.last_refused_run(fingerprint, config_hash)


@task(cache_policy=NO_CACHE, name="prepare_warm_start", **transient_retries())
def prepare_warm_start(config: PipelineConfig, champion: VersionInfo) -> str:
    target = storage.join(config.output_root, "warm_start", f"{champion.name}-v{champion.version}")
    with tempfile.TemporaryDirectory(prefix="tfdag-champion-") as tmp:
        keras_path = open_tracker(config).download_keras_model(champion.name, champion.version, tmp)
        prefix = write_warm_start_checkpoint(keras_path, target, config.storage_options)
    get_run_logger().info("warm start from %s version %d: %s", champion.name, champion.version, prefix)
    return prefix


@task(cache_policy=NO_CACHE, name="evaluate_champion", **transient_retries(1))
def evaluate_champion(config: PipelineConfig, manifest: Manifest, champion: VersionInfo) -> EvalReport:
    """The champion on the challenger's eval split: the same manifest, the same evaluation function."""
    with tempfile.TemporaryDirectory(prefix="tfdag-champion-") as tmp:
        keras_path = open_tracker(config).download_keras_model(champion.name, champion.version, tmp)
        report = evaluation.evaluate(config, manifest, keras_path)
    get_run_logger().info("champion %s v%d on the new eval split: %s", champion.name, champion.version,
                          ", ".join(f"{k}={v:.4f}" for k, v in report.metrics.items()))
    return report


@task(cache_policy=NO_CACHE, name="record_decision", **transient_retries())
def record_decision(config: PipelineConfig, challenger_version: int, decision: GateDecision,
                    fingerprint: SourceFingerprint, config_hash: str) -> VersionInfo:
    name = config.tracking.registered_model
    assert name is not None
    return open_tracker(config).record_decision(name, challenger_version, decision, fingerprint=fingerprint,
                                                config_hash=config_hash)
