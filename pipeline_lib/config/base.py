"""Shared pieces of the configuration: the error, the frozen base model, the enums, and the one rule for
which way a metric improves and what `auto` means on a cluster."""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainSerializer, SerializationInfo

from pipeline_lib.core.errors import UserError
from pipeline_lib.core.secrets import serialize_secrets

DEFAULT_ROOT = "./.tfdag"


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the key path, source, value and fix."""


def _serialize_secrets(value: Any, info: SerializationInfo) -> Any:
    return serialize_secrets(value, info.context)


_SECRETS = PlainSerializer(_serialize_secrets)
# The fields that can hold a credential. Every dump of a config (a Prefect parameter, the MLflow config artifact, a
# worker spec, a reproduce record, a log line) goes through this one serializer: a secret is written masked or as a
# `${NAME}` reference, never as its value (core.secrets.serialize_secrets; the context decides which).
SecretSettings = Annotated[dict[str, Any], _SECRETS]
SecretUri = Annotated[str | None, _SECRETS]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, use_enum_values=False)

    def __repr_args__(self):
        # repr() is no dump, yet a traceback or a log line may show it: the credential fields masked there too.
        for name, value in super().__repr_args__():
            field = type(self).model_fields.get(name) if name else None
            yield name, serialize_secrets(value, None) if field is not None and _SECRETS in field.metadata else value


class DataFormat(str, enum.Enum):
    AUTO = "auto"
    CSV = "csv"
    PARQUET = "parquet"
    JSONL = "jsonl"
    NPZ = "npz"


class OnBadRecord(str, enum.Enum):
    FAIL = "fail"
    SKIP = "skip"


class MissingPolicy(str, enum.Enum):  # `data.missing`: what a missing feature value does
    FAIL = "fail"  # conversion stops, naming the file, line and column
    SKIP = "skip"  # the row is dropped and counted with the bad records
    IMPUTE = "impute"  # the value is filled in inside the model (numbers) or becomes out-of-vocabulary (strings)


class ImputeWith(str, enum.Enum):  # `data.impute_with`, from the train split's statistics
    MEAN = "mean"
    MEDIAN = "median"
    CONSTANT = "constant"  # data.impute_value


class Compression(str, enum.Enum):
    NONE = "none"
    GZIP = "gzip"


class DataEngine(str, enum.Enum):
    """Where conversion runs: in the flow's process, or as tasks on the Ray cluster of train.ray.address."""

    LOCAL = "local"
    RAY = "ray"


class Strategy(str, enum.Enum):
    AUTO = "auto"
    DEFAULT = "default"
    ONE_DEVICE = "one_device"
    MIRRORED = "mirrored"
    MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
    PARAMETER_SERVER = "parameter_server"
    TPU = "tpu"


class LrScaling(str, enum.Enum):
    LINEAR = "linear"
    SQRT = "sqrt"
    NONE = "none"


class Collective(str, enum.Enum):
    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


class AutoShard(str, enum.Enum):
    AUTO = "auto"  # FILE when the files balance over the workers, else DATA
    FILE = "file"
    DATA = "data"


class Task(str, enum.Enum):
    CLASSIFICATION = "classification"
    REGRESSION = "regression"


class Direction(str, enum.Enum):
    MAX = "max"
    MIN = "min"


class RegisterPolicy(str, enum.Enum):
    """`tracking.register`: which models reach the registry."""

    BLESSED = "blessed"  # only a model the gate blessed; any other is logged to its run only
    ALWAYS = "always"  # every model; one the gate did not bless is tagged blessed=false and gets no alias


# Metrics where a smaller value is better, whatever a configured direction says. The one copy of this rule:
# the gate, the champion policy and best-checkpoint selection all ask metric_direction().
LOWER_IS_BETTER_METRICS = frozenset({"loss", "mae", "rmse"})


def metric_direction(metric: str, declared: Direction = Direction.MAX) -> Direction:
    """The direction in which `metric` improves: MIN for loss, mae and rmse (also as `eval_*`), else `declared`."""
    name = metric.removeprefix("eval_")
    return Direction.MIN if name in LOWER_IS_BETTER_METRICS else Direction(declared)



def strategy_for_cluster(strategy: Strategy, *, has_ps: bool, num_workers: int) -> Strategy:
    """`auto` resolved from the cluster alone: parameter_server when it has ps tasks, multi_worker_mirrored with
    more than one worker, else still `auto` (the local devices decide). Any other strategy is returned as is."""
    if strategy != Strategy.AUTO:
        return strategy
    if has_ps:
        return Strategy.PARAMETER_SERVER
    if num_workers > 1:
        return Strategy.MULTI_WORKER_MIRRORED
    return Strategy.AUTO
