"""A model made as the pipeline makes one, for the serving tests: converted, trained, exported, logged to MLflow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.evaluation import consolidation
from pipeline_lib.planning import sharding
from pipeline_lib.serving import rows, validation
from pipeline_lib.tracking import model_logging
from pipeline_lib.tracking import run as tracking
from pipeline_lib.training import loop as training


@dataclass(frozen=True)
class LoggedModel:
    manifest: Manifest
    export: Any  # consolidation's export record: saved_model_dir, keras_path
    logged: Any  # model_logging's record: model_uri
    sample: Any  # a few raw eval rows, as the model check sends them


def train_export_and_log(config: PipelineConfig, root) -> LoggedModel:
    """`config`'s data converted, trained on one worker, exported under `root`/run and logged to its MLflow store."""
    manifest = convert(config.data, config.output_root)
    result = training.train(config, manifest, sharding.plan_for_train(manifest, config.train, 1), str(root / "run"))
    export = consolidation.consolidate(config, manifest, result, str(root / "run" / "export"))
    run_id = tracking.start_run(config, "check")
    logged = model_logging.log_model(run_id, config.mlflow_uri, export.saved_model_dir, export.keras_path, manifest)
    return LoggedModel(manifest, export, logged, rows.raw_rows(manifest, validation.DEFAULT_NUM_ROWS))
