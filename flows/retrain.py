"""The `retrain` flow: train only on new data, and move the `champion` alias only to a challenger that beats it."""

from __future__ import annotations

import math
from typing import Any, Literal

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.exceptions import TerminationSignal
from prefect.states import Completed
from pydantic import BaseModel, ConfigDict, Field

from flows.pipeline import (
    DEFAULT_CONFIG,
    PipelineSummary,
    end_tracking_run,
    run_pipeline,
)
from pipeline_lib.config import ConfigError, PipelineConfig, resolve_config
from pipeline_lib.data import demo as demo_data
from pipeline_lib.evaluation.report import EvalReport
from pipeline_lib.tracking import registry
from pipeline_lib.tracking.run import RunStatus
from tasks.retrain import (
    evaluate_champion,
    find_champion,
    fingerprint_source,
    prepare_warm_start,
    record_decision,
)
from tasks.stages import _key

RETRAIN_RUN_TAG = "tfdag.retrain_flow_run_id"


class RetrainParameters(BaseModel):
    """What one retrain run is asked to do (the deployment's parameter form)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: str = Field(DEFAULT_CONFIG, description="Pipeline YAML: a path (relative to the project root) "
                                                    "or inline YAML.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Dotted config keys to replace, e.g. "
                                      '{"train.epochs": 3, "evaluation.gate.threshold": null}.')
    warm_start: bool = Field(False, description="Start the challenger from the champion's weights.")
    force: bool = Field(False, description="Train even when the source data has not changed.")


DEFAULT_PARAMETERS = RetrainParameters()


class RetrainResult(BaseModel):
    """What one retrain run did."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Literal["skipped", "promoted", "not_promoted"]
    message: str
    model_name: str
    source_fingerprint: str
    champion_before: int | None
    champion_after: int | None
    challenger_version: int | None = None
    decision: registry.Decision | None = None
    mlflow_run_id: str | None = None
    challenger_metrics: dict[str, float] = Field(default_factory=dict)
    champion_metrics: dict[str, float] = Field(default_factory=dict)


def load_retrain_config(params: RetrainParameters) -> PipelineConfig:
    """The pipeline config with the overrides applied, checked for what retraining needs.

    Raises:
        ConfigError: when the config is invalid or has no registered model to compare against.
    """
    config = resolve_config(params.config)
    if params.overrides:
        config = registry.apply_overrides(config, params.overrides, source=f"overrides of {params.config}")
    if not config.tracking.enabled or not config.tracking.registered_model:
        raise ConfigError(
            f"tracking.registered_model ({config.tracking.registered_model!r}) with tracking.enabled "
            f"({config.tracking.enabled}) in {params.config}: retraining compares a challenger with the registered "
            "champion; set tracking.enabled: true and tracking.registered_model: <name>"
        )
    return config


@flow(name="training-pipeline", log_prints=True)
def challenger_pipeline(config: PipelineConfig, extra_tags: dict[str, str]) -> PipelineSummary:
    """The training pipeline as a subflow of the retrain run, its versions tagged with the source fingerprint."""
    return run_pipeline(config, extra_tags=extra_tags)


def _score(metrics: dict[str, float], metric: str) -> float | None:
    value = metrics.get(metric)
    return None if value is None else float(value)


def _comparison_rows(challenger: int, summary: PipelineSummary, champion: registry.VersionInfo | None,
                     champion_report: EvalReport | None) -> list[dict[str, Any]]:
    rows = [{"model": f"challenger v{challenger}", **{k: round(v, 6) for k, v in summary.metrics.items()}}]
    if champion is not None and champion_report is not None:
        rows.append({"model": f"champion v{champion.version}",
                     **{k: round(v, 6) for k, v in champion_report.metrics.items()}})
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in rows]


def _ui_link(mlflow_uri: str, name: str, version: int) -> str | None:
    if not mlflow_uri.startswith(("http://", "https://")):
        return None
    return f"{mlflow_uri.rstrip('/')}/#/models/{name}/versions/{version}"


@flow(name="retrain", log_prints=True)
def retrain(params: RetrainParameters = DEFAULT_PARAMETERS):
    """Retrain when the source data changed, and promote the challenger only when it beats the champion.

    Unchanged data (the champion's source fingerprint) finishes Completed with "no new data since version N".
    Otherwise the training pipeline runs as a subflow; the champion is evaluated on the same new eval split;
    the `champion` alias moves only when the challenger beats it by `evaluation.min_improvement` on
    `evaluation.gate.metric`; the challenger's version is tagged `blessed=true|false` with both scores.

    Args:
        params: the config path or inline YAML, dotted-key overrides, warm start and force.

    Returns:
        A Completed state whose message says what happened and whose result is the RetrainResult.
    """
    logger = get_run_logger()
    stage = "load_config"
    config: PipelineConfig | None = None
    summary: PipelineSummary | None = None
    try:
        config = load_retrain_config(params)
        name = config.tracking.registered_model
        assert name is not None
        stage = "fingerprint_source"
        demo_data.ensure_demo_source(config.data)
        fingerprint = fingerprint_source(config)
        stage = "find_champion"
        champion, latest = find_champion(config)
        config_hash = config.config_hash()
        check = registry.check_for_new_data(fingerprint, config_hash, champion, latest)
        champion_version = champion.version if champion else None
        if not check.train and not params.force:
            logger.info(check.message)
            create_markdown_artifact(f"# Retrain `{config.name}`: skipped\n\n{check.message}\n",
                                     key=_key(f"{config.name}-retrain-decision"), description="Retrain decision")
            result = RetrainResult(status="skipped", message=check.message, model_name=name,
                                   source_fingerprint=fingerprint.sha256, champion_before=champion_version,
                                   champion_after=champion_version)
            return Completed(message=check.message, data=result)
        logger.info(check.message if check.train else f"force=true: training although {check.message}")

        train_config = config
        if params.warm_start and champion is not None:
            stage = "prepare_warm_start"
            uri = prepare_warm_start(config, champion)
            train_config = registry.apply_overrides(config, {"train.warm_start_uri": uri},
                                                    source="the champion's warm start")
        stage = "training-pipeline"
        tags = {registry.FINGERPRINT_TAG: fingerprint.sha256, registry.CONFIG_HASH_TAG: config_hash,
                RETRAIN_RUN_TAG: str(runtime.flow_run.id or "")}
        summary = challenger_pipeline(train_config, tags)
        if summary.model_version is None:
            raise RuntimeError(f"the training pipeline registered no version of {name!r} (MLflow run "
                               f"{summary.mlflow_run_id}); check the track stage's log")
        challenger = int(summary.model_version)

        champion_report = None
        if champion is not None:
            stage = "evaluate_champion"
            champion_report = evaluate_champion(config, summary.data_fingerprint, champion)
        stage = "record_decision"
        metric = config.evaluation.gate.metric
        decision = registry.decide(_score(summary.metrics, metric),
                                   _score(champion_report.metrics, metric) if champion_report else None,
                                   config.evaluation.gate, config.evaluation.effective_min_improvement,
                                   champion_version=champion_version)
        record_decision(config, challenger, decision, fingerprint, config_hash)

        rows = _comparison_rows(challenger, summary, champion, champion_report)
        create_table_artifact(rows, key=_key(f"{config.name}-champion-vs-challenger"),
                              description=f"Challenger and champion on the same eval split ({metric})")
        verdict = "promoted to champion" if decision.blessed else "not promoted"
        message = f"{name} version {challenger} {verdict}: {decision.reason}"
        create_markdown_artifact(
            f"# Retrain `{config.name}`: version {challenger} {verdict}\n\n{check.message}\n\n{decision.reason}\n",
            key=_key(f"{config.name}-retrain-decision"), description="Retrain decision")
        link = _ui_link(config.mlflow_uri, name, challenger)
        if link:
            create_link_artifact(link, link_text=f"{name} version {challenger}",
                                 key=_key(f"{config.name}-model-version"))
        logger.info(message)
        result = RetrainResult(
            status="promoted" if decision.blessed else "not_promoted", message=message, model_name=name,
            source_fingerprint=fingerprint.sha256, champion_before=champion_version,
            champion_after=challenger if decision.blessed else champion_version, challenger_version=challenger,
            decision=decision, mlflow_run_id=summary.mlflow_run_id, challenger_metrics=summary.metrics,
            champion_metrics=champion_report.metrics if champion_report else {},
        )
        return Completed(message=message, data=result)
    except (KeyboardInterrupt, TerminationSignal):
        logger.error("retrain stopped in stage %s", stage)
        _end_challenger_run(config, summary, RunStatus.KILLED, stage)
        raise
    except Exception as error:
        create_markdown_artifact(
            f"# Retrain failed\n\n**Stage:** `{stage}`\n\n**Error:**\n\n```\n{error}\n```\n",
            key="retrain-failure", description=f"failed in stage {stage}")
        logger.error("retrain failed in stage %s: %s", stage, error)
        _end_challenger_run(config, summary, RunStatus.FAILED, stage)
        raise


def _end_challenger_run(config: PipelineConfig | None, summary: PipelineSummary | None, status: RunStatus,
                        stage: str) -> None:
    """A failure after the training subflow ended the challenger's MLflow run FINISHED marks that run too.

    A failure inside the subflow has already ended the run with its own stage; before it there is no run.
    """
    if config is not None and summary is not None:
        end_tracking_run(config, summary.mlflow_run_id, status, stage)
