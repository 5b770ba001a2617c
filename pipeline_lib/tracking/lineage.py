"""Where a run's data and code came from, as MLflow 3 shows it: the dataset inputs built from the manifest, the
source tags, and the experiment kind that opens the experiment in MLflow's model-training view."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from typing import Any

from pipeline_lib.core import storage
from pipeline_lib.data.manifest import DType, FeatureSpec, Manifest
from pipeline_lib.tracking.client import create_client

logger = logging.getLogger(__name__)

# MLflow 3's experiment kind: "custom_model_development" opens the model-training view, not the GenAI one.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# MLflow 3.17's UI picks its GenAI or model-training view from this URL parameter (else the browser's last choice,
# GenAI at first): the links tfdag gives carry it.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
# MLflow's own limit on a dataset digest (mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE).
_MAX_DIGEST = 36
# The context MLflow shows beside each dataset of a run.
SPLIT_CONTEXTS = {"train": "training", "eval": "evaluation"}


def mark_model_training(client, experiment_id: str) -> None:
    """Tag the experiment as model training, unless someone chose another kind."""
    experiment = client.get_experiment(experiment_id)
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)


def git_commit(directory: str | None = None) -> str | None:
    """The commit checked out in `directory` (default: the working directory), None outside a git work tree."""
    try:
        done = subprocess.run(["git", "-C", directory or os.getcwd(), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) == 40 else None


def source_tags(flow_name: str | None, deployment_name: str | None, commit: str | None) -> dict[str, str]:
    """MLflow's source tags: what the run page shows as Source (the Prefect flow and deployment) and its commit."""
    name = f"prefect flow {flow_name or 'training-pipeline'}"
    if deployment_name:
        name += f" / deployment {deployment_name}"
    tags = {"mlflow.source.type": "JOB", "mlflow.source.name": name}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def _column(spec: FeatureSpec) -> Any:
    from mlflow.types.schema import Array, ColSpec, DataType

    kind = {DType.FLOAT32: DataType.float, DType.INT64: DataType.long, DType.STRING: DataType.string}[spec.dtype]
    if spec.time is not None:  # an int64 instant (days or microseconds since 1970) of a date or timestamp column
        kind = DataType.datetime
    return ColSpec(Array(kind) if spec.shape else kind, spec.name)


def manifest_datasets(manifest: Manifest, name: str) -> list[tuple[Any, str]]:
    """One MLflow dataset per non-empty split of the manifest, with its context: the TFRecords' URI as the source,
    the data fingerprint as the digest, the schema, and the split's rows and shards as the profile."""
    from mlflow.data.dataset_source_registry import (
        get_registered_sources,
        resolve_dataset_source,
    )
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import Schema

    class ManifestDataset(MetaDataset):
        def __init__(self, profile: dict[str, Any], **kwargs: Any):
            self._profile = profile
            super().__init__(**kwargs)

        @property
        def profile(self) -> dict[str, Any]:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile)}

    schema = manifest.feature_schema
    columns = Schema([_column(f) for f in (*schema.features, schema.label)])
    uri = manifest.dataset_uri
    if storage.is_local(uri):
        # MLflow registers its local source twice and would warn that a path is ambiguous: pick it directly.
        local = [s for s in get_registered_sources() if s._get_source_type() == "local"]
        source = local[-1](storage.local_path(uri))
    else:
        # MLflow's Azure source knows only its wasbs:// form of an az:// URI.
        source = resolve_dataset_source(storage.mlflow_artifact_uri(uri, "output_root"))
    datasets = []
    for split, context in SPLIT_CONTEXTS.items():
        rows = manifest.num_records(split)
        if not rows:
            continue
        profile = {"split": split, "num_rows": rows, "num_shards": sum(1 for s in manifest.shards if s.split == split),
                   "fingerprint": manifest.fingerprint, "label": schema.label.name}
        datasets.append((ManifestDataset(profile, source=source, name=f"{name}-{split}",
                                         digest=manifest.fingerprint[:_MAX_DIGEST], schema=columns), context))
    return datasets


def log_datasets(run_id: str, tracking_uri: str, manifest: Manifest, name: str) -> None:
    """Log the manifest's splits as the run's dataset inputs (the run page's Datasets)."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = [DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
              for dataset, context in manifest_datasets(manifest, name)]
    create_client(tracking_uri).log_inputs(run_id, datasets=inputs)
    logger.info("logged %d dataset input(s) to MLflow run %s", len(inputs), run_id)
