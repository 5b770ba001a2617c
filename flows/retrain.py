"""The `retrain` flow: train only on new data, and move the `champion` alias only to a challenger that beats it."""

from __future__ import annotations

import math
from typing import Any, Literal

from pipeline_lib.core.quiet import import_tensorflow

# A flow-run process (a Prefect worker's) loads TensorFlow here, before anything else does: its start-up lines
# held back unless TFDAG_VERBOSE=1.
import_tensorflow()

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.states import Completed
from pydantic import BaseModel, ConfigDict, Field

from flows.flow_config import refuse_recorded_secrets
from flows.pipeline import (
    DEFAULT_CONFIG,
    PipelineSummary,
    final_state,
    run_pipeline,
)
from pipeline_lib.config import ConfigError, PipelineConfig, resolve_config
from pipeline_lib.config.overrides import apply_overrides
from pipeline_lib.config.pipeline import is_inline
from pipeline_lib.core.secrets import mask_secrets
from pipeline_lib.data import demo as demo_data
from pipeline_lib.evaluation.report import GateDecision
from pipeline_lib.tracking.registration import check_for_new_data
from pipeline_lib.tracking.tracker import CONFIG_HASH_TAG, FINGERPRINT_TAG
from tasks.lifecycle import tracked_run
from tasks.retrain import (
    find_champion,
    find_last_attempt,
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
    decision: GateDecision | None = None
    mlflow_run_id: str | None = None
    challenger_metrics: dict[str, float] = Field(default_factory=dict)
    champion_metrics: dict[str, float] = Field(default_factory=dict)


def load_retrain_config(params: RetrainParameters) -> PipelineConfig:
    """The pipeline config with the overrides applied, checked for what retraining needs.

    Prefect records the parameters as given: a literal secret in inline YAML or in an override is refused
    (flows.pipeline.refuse_recorded_secrets); one in a YAML file named by its path is not recorded.

    Raises:
        ConfigError: when the config is invalid, holds a literal secret Prefect recorded, or has no registered model
            to compare against.
    """
    given = resolve_config(params.config)
    config = given
    if params.overrides:
        config = apply_overrides(config, params.overrides, source=f"overrides of {params.config}")
    inline = is_inline(params.config)
    found = [where for where in config.literal_secrets()
             if inline or any(where == key or where.startswith((f"{key}.", f"{key}[")) for key in params.overrides)]
    masked = params.model_dump(mode="json") | {"config": given.masked_yaml() if inline else params.config,
                                               "overrides": mask_secrets(params.overrides)}
    refuse_recorded_secrets(found, "params.config" if inline else "params.overrides", {"params": masked})
    if not config.tracking.enabled or not config.tracking.registered_model:
        raise ConfigError(
            f"tracking.registered_model ({config.tracking.registered_model!r}) with tracking.enabled "
            f"({config.tracking.enabled}) in {params.config}: retraining compares a challenger with the registered "
            "champion; set tracking.enabled: true and tracking.registered_model: <name>"
        )
    return config


@flow(name="training-pipeline", log_prints=True)
def challenger_pipeline(config: PipelineConfig, extra_tags: dict[str, str]) -> PipelineSummary:
    """The training pipeline as a subflow of the retrain run, its runs and versions tagged with the source
    fingerprint; its gate compares the challenger with the champion."""
    return final_state(run_pipeline(config, extra_tags=extra_tags))  # type: ignore[return-value]


def _comparison_rows(summary: PipelineSummary) -> list[dict[str, Any]]:
    challenger = f"challenger v{summary.model_version}" if summary.model_version else "challenger (not registered)"
    rows = [{"model": challenger, **{k: round(v, 6) for k, v in summary.metrics.items()}}]
    if summary.champion_metrics:
        rows.append({"model": f"champion v{summary.gate.champion_version}",
                     **{k: round(v, 6) for k, v in summary.champion_metrics.items()}})
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in rows]


def _ui_link(mlflow_uri: str, name: str, version: int) -> str | None:
    if not mlflow_uri.startswith(("http://", "https://")):
        return None
    return f"{mlflow_uri.rstrip('/')}/#/models/{name}/versions/{version}"


@flow(name="retrain", log_prints=True)
def retrain(params: RetrainParameters = DEFAULT_PARAMETERS):
    """Retrain when the source data changed, and promote the challenger only when it beats the champion.

    Unchanged data (the champion's source fingerprint, or a refused challenger's with the same config) finishes
    Completed with "no new data since ...". Otherwise the training pipeline runs as a subflow; its gate evaluates
    the champion on the same new eval split and blesses the challenger only when it beats the champion by
    `evaluation.min_improvement` on `evaluation.gate.metric`. A blessed challenger is registered and takes the
    `champion` alias; one that is not blessed is registered only with `tracking.register: always` (tagged
    `blessed=false`).

    Args:
        params: the config path or inline YAML, dotted-key overrides, warm start and force.

    Returns:
        A Completed state whose message says what happened and whose result is the RetrainResult.
    """
    logger = get_run_logger()
    # A failure after the training subflow also marks the challenger's run, which the subflow ended FINISHED; a
    # failure inside the subflow has already ended it with its own stage; before it there is no run.
    with tracked_run(None, subject="retrain", heading="Retrain", failure_key="retrain-failure", finish_stage=False,
                     emit_events=False) as lifecycle:
        lifecycle.config = config = load_retrain_config(params)
        name = config.tracking.registered_model
        assert name is not None
        lifecycle("fingerprint_source")
        demo_data.ensure_demo_source(config.data)
        fingerprint = fingerprint_source(config)
        lifecycle("find_champion")
        champion = find_champion(config)
        config_hash = config.config_hash()
        latest, refused_run = find_last_attempt(config, fingerprint, config_hash)
        check = check_for_new_data(fingerprint, config_hash, champion, latest, refused_run)
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
            lifecycle("prepare_warm_start")
            uri = prepare_warm_start(config, champion)
            train_config = apply_overrides(config, {"train.warm_start_uri": uri},
                                                    source="the champion's warm start")
        lifecycle("training-pipeline")
        tags = {FINGERPRINT_TAG: fingerprint.sha256, CONFIG_HASH_TAG: config_hash,
                RETRAIN_RUN_TAG: str(runtime.flow_run.id or "")}
        summary = challenger_pipeline(train_config, tags)
        lifecycle.adopt_run(summary.mlflow_run_id)
        decision = summary.gate
        challenger = int(summary.model_version) if summary.model_version else None
        if challenger is not None:
            lifecycle("record_decision")
            record_decision(config, challenger, decision, fingerprint, config_hash)

        metric = config.evaluation.gate.metric
        create_table_artifact(_comparison_rows(summary), key=_key(f"{config.name}-champion-vs-challenger"),
                              description=f"Challenger and champion on the same eval split ({metric})")
        subject = f"{name} version {challenger}" if challenger is not None else f"the challenger of {name}"
        verdict = "promoted to champion" if decision.blessed else (
            "not promoted" if challenger is not None else "not promoted (not registered)")
        message = f"{subject} {verdict}: {decision.reason}"
        create_markdown_artifact(
            f"# Retrain `{config.name}`: {subject} {verdict}\n\n{check.message}\n\n{decision.reason}\n",
            key=_key(f"{config.name}-retrain-decision"), description="Retrain decision")
        link = _ui_link(config.mlflow_uri_shown, name, challenger) if challenger is not None else None
        if link:
            create_link_artifact(link, link_text=f"{name} version {challenger}",
                                 key=_key(f"{config.name}-model-version"))
        logger.info(message)
        result = RetrainResult(
            status="promoted" if decision.blessed else "not_promoted", message=message, model_name=name,
            source_fingerprint=fingerprint.sha256, champion_before=champion_version,
            champion_after=challenger if decision.blessed else champion_version, challenger_version=challenger,
            decision=decision, mlflow_run_id=summary.mlflow_run_id, challenger_metrics=summary.metrics,
            champion_metrics=summary.champion_metrics,
        )
        return Completed(message=message, data=result)
