"""What a launcher hands a worker process: the WorkerSpec, its environment variables, its exit and result contract."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import PipelineConfig, parse_config
from pipeline_lib.core import storage
from pipeline_lib.core.exit_codes import EXIT_BAD_INPUT
from pipeline_lib.planning.sharding import ShardPlan

# 138 = 128 + SIGUSR1: the exit code Kubeflow's TFJob `restartPolicy: ExitCode` reserves for user-defined
# retryable errors (kubeflow/training-operator train_util.IsRetryableExitCode), so a TFJob restarts a
# preempted pod just as our launcher does. 1 (exception) and 2 (usage) stay permanent.
PREEMPTION_EXIT_CODE = 138
# A UserError in a worker (a model factory that rejects its params, a strategy this machine cannot run): the
# worker prints one line, USER_ERROR_PREFIX + the message, and exits 2 (permanent, like a usage error); the
# launcher raises it in the flow process as a WorkerInputError, a UserError the CLI prints as one line.
USER_ERROR_EXIT_CODE = EXIT_BAD_INPUT
USER_ERROR_PREFIX = "tfdag user error: "
# The chief writes its TrainResult here, in the run dir, before it exits 0.
RESULT_NAME = "result.json"
# The launcher's pid: a worker asks Linux to kill it when that process dies.
PARENT_PID_ENV = "TFDAG_PARENT_PID"


class WorkerSpec(BaseModel):
    """Everything a worker needs besides TF_CONFIG; written by the launcher (or a pod's init) as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any]  # PipelineConfig.for_process()'s values: literal secrets as ${TFDAG_SECRET_…} references
    dataset_uri: str  # the manifest's dataset_uri
    plan: ShardPlan
    run_dir: str
    mlflow_run_id: str | None = None
    heartbeat_dir: str  # a local directory the supervisor watches

    def pipeline_config(self) -> PipelineConfig:
        return parse_config(self.config, source="the worker spec's config")


SPEC_NAME = "worker_spec.json"


def write_spec(spec: WorkerSpec, directory: str) -> str:
    """Write `spec` as `<directory>/worker_spec.json`, readable by its owner only (0600), and return its path.

    The spec holds no secret (its config went through `PipelineConfig.for_process`); 0600 all the same, and the
    launcher removes the directory when the launch ends.
    """
    path = os.path.join(directory, SPEC_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(spec.model_dump_json())
    return path


def load_spec(spec_uri: str) -> WorkerSpec:
    """Read a WorkerSpec JSON from a path or fsspec URI."""
    fs, path = storage.get_fs(spec_uri)
    with fs.open(path, "rb") as handle:
        return WorkerSpec.model_validate_json(handle.read())
