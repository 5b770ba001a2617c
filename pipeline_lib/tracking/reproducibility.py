"""What a run records so that `tfdag reproduce` can rerun it: the environment, the data and the final weights."""

from __future__ import annotations

import importlib.metadata
import io
import json
import platform
import sys
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import PipelineConfig, Strategy
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.training.results import TrainResult

# Artifact paths in the MLflow run: the one place both the recording and `reproduce` read them from.
CONFIG_ARTIFACT = "config/pipeline.yaml"
MANIFEST_ARTIFACT = "data/manifest.json"
SHARD_PLAN_ARTIFACT = "data/shard_plan.json"
PIP_FREEZE_ARTIFACT = "environment/pip_freeze.txt"
TF_BUILD_ARTIFACT = "environment/tensorflow_build.json"
RECORD_ARTIFACT = "reproduce/record.json"
WEIGHTS_ARTIFACT = "reproduce/weights.npz"


class ReproductionRecord(BaseModel):
    """The facts of a run that decide its weights, besides the config and the data (artifacts of their own)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    strategy: str
    num_workers: int
    num_replicas: int
    per_replica_batch_size: int
    global_batch_size: int
    total_steps: int
    seed: int
    split_seed: int
    deterministic: bool
    shuffle: bool
    jit_compile: bool
    data_fingerprint: str
    manifest_hash: str  # Manifest.content_hash(): the shards' digests and the schema
    dataset_uri: str
    export_step: int  # the checkpoint the exported model (and weights.npz) came from
    export_selected_by: str
    tensorflow_version: str
    keras_version: str
    python_version: str

    def why_not_reproducible(self) -> str | None:
        if self.strategy == Strategy.PARAMETER_SERVER.value:
            return ("it trained under parameter_server, whose workers update the parameters asynchronously in an "
                    "order no seed fixes")
        if not self.deterministic:
            return "it trained with train.deterministic: false (op determinism off)"
        return None


def installed_distributions() -> dict[str, str]:
    """Every installed distribution's version, by normalised name (what `pip freeze` lists)."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(_normalise(name), dist.version)
    return dict(sorted(found.items()))


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip_freeze() -> str:
    """The `pip freeze` of this interpreter, `name==version` a line, read from the installed metadata."""
    return "".join(f"{name}=={version}\n" for name, version in installed_distributions().items())


def parse_pip_freeze(text: str) -> dict[str, str]:
    """`name==version` lines back into {normalised name: version}; other lines (editable, URLs) are skipped."""
    versions = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith(("#", "-")):
            versions[_normalise(name)] = version.strip()
    return versions


def version_differences(recorded: Mapping[str, str], installed: Mapping[str, str]) -> list[str]:
    """`name recorded → installed` for each package whose version differs or that is missing on one side."""
    lines = []
    for name in sorted(set(recorded) | set(installed)):
        before, now = recorded.get(name), installed.get(name)
        if before != now:
            lines.append(f"{name} {before or '(not installed)'} → {now or '(not installed)'}")
    return lines


def tensorflow_build_info() -> dict[str, Any]:
    """TensorFlow's build (CUDA/cuDNN, compiler flags), the versions that run it, and the machine."""
    build = {k: (v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
             for k, v in tf.sysconfig.get_build_info().items()}
    return {
        "tensorflow_version": tf.__version__,
        "tensorflow_git_version": tf.version.GIT_VERSION,
        "keras_version": keras.__version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "build_info": build,
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
    }


def build_record(config: PipelineConfig, train_result: TrainResult, plan: ShardPlan, manifest: Manifest,
                 export_step: int, export_selected_by: str) -> ReproductionRecord:
    """The record of a finished run, from its typed config and results."""
    return ReproductionRecord(
        strategy=train_result.strategy, num_workers=train_result.num_workers, num_replicas=train_result.num_replicas,
        per_replica_batch_size=train_result.per_replica_batch_size, global_batch_size=train_result.global_batch_size,
        total_steps=plan.total_steps, seed=config.train.seed, split_seed=config.data.split.seed,
        deterministic=config.train.deterministic, shuffle=config.train.shuffle, jit_compile=config.train.jit_compile,
        data_fingerprint=manifest.fingerprint, manifest_hash=manifest.content_hash(), dataset_uri=manifest.dataset_uri,
        export_step=export_step, export_selected_by=export_selected_by, tensorflow_version=tf.__version__,
        keras_version=keras.__version__, python_version=sys.version.split()[0],
    )


def model_weights(model: keras.Model) -> dict[str, np.ndarray]:
    """The model's weights by variable path (`dense_0/kernel`), the keys `weights.npz` holds."""
    return {weight.path: np.asarray(weight.numpy()) for weight in model.weights}


def weights_to_npz(weights: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **dict(weights))
    return buffer.getvalue()


def weights_from_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as loaded:
        return {name: loaded[name] for name in loaded.files}


def reproduction_artifacts(record: ReproductionRecord, weights: Mapping[str, np.ndarray]) -> dict[str, str | bytes]:
    """The artifacts `reproduce` needs beyond config and data: the record, the weights, pip freeze, TF's build."""
    return {
        RECORD_ARTIFACT: record.model_dump_json(indent=2),
        WEIGHTS_ARTIFACT: weights_to_npz(weights),
        PIP_FREEZE_ARTIFACT: pip_freeze(),
        TF_BUILD_ARTIFACT: json.dumps(tensorflow_build_info(), indent=2, sort_keys=True),
    }
