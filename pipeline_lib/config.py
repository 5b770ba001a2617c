"""Pipeline configuration: frozen pydantic models loaded from one YAML file per pipeline."""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline_lib.core.errors import UserError
from pipeline_lib.core.secrets import mask_secrets, mask_url_passwords

DEFAULT_ROOT = "./.tfdag"


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the key path, source, value and fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


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


class SplitConfig(_Frozen):
    """Deterministic hash split of rows into train and eval."""

    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    seed: int = 0
    key_columns: tuple[str, ...] | None = None  # None: hash the whole row


class ColumnMissingConfig(_Frozen):
    """`data.missing_columns.<column>`: per-column overrides of the missing-value settings (unset: the data default)."""

    missing: MissingPolicy | None = None
    impute_with: ImputeWith | None = None
    impute_value: float | None = None
    missing_indicator: bool | None = None


class ColumnMissing(_Frozen):  # the settings that apply to one column, overrides resolved
    missing: MissingPolicy
    impute_with: ImputeWith
    impute_value: float
    missing_indicator: bool


class DataConfig(_Frozen):
    source: str  # fsspec URI or glob
    format: DataFormat = DataFormat.AUTO
    label: str
    features: tuple[str, ...] | None = None  # None: every column but the label
    storage_options: dict[str, Any] = Field(default_factory=dict)
    split: SplitConfig = SplitConfig()
    target_shard_mb: float = Field(8.0, gt=0.0)
    compression: Compression = Compression.NONE
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    csv_delimiter: str = ","
    read_chunk_rows: int = Field(65536, ge=1)
    missing: MissingPolicy = MissingPolicy.IMPUTE  # features only: a missing label is a bad record
    impute_with: ImputeWith = ImputeWith.MEAN
    impute_value: float = 0.0  # with impute_with: constant
    missing_indicator: bool = False  # impute: add a `<column>_missing` 0/1 input to the model
    missing_columns: dict[str, ColumnMissingConfig] = Field(default_factory=dict)

    def missing_for(self, column: str) -> ColumnMissing:
        """The missing-value settings of `column`: its `missing_columns` entry over the data defaults."""
        override = self.missing_columns.get(column, ColumnMissingConfig())
        return ColumnMissing(
            missing=override.missing or self.missing,
            impute_with=override.impute_with or self.impute_with,
            impute_value=self.impute_value if override.impute_value is None else override.impute_value,
            missing_indicator=(self.missing_indicator if override.missing_indicator is None
                               else override.missing_indicator),
        )

    @model_validator(mode="after")
    def _missing_label(self) -> DataConfig:
        if self.label in self.missing_columns:
            raise ValueError(f"missing_columns names the label {self.label!r}; a missing label is never imputed "
                             "but a bad record (data.on_bad_record decides); remove it from missing_columns")
        return self

    @field_validator("source")
    @classmethod
    def _source_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty fsspec URI or glob, e.g. ./data/*.csv or s3://bucket/raw/*.parquet")
        return value


class ModelConfig(_Frozen):
    factory: str = "mlp"  # "mlp", "cnn" or "module:function"
    params: dict[str, Any] = Field(default_factory=dict)
    task: Task = Task.CLASSIFICATION
    num_classes: int | None = Field(None, ge=2)  # None: inferred from the label values

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, value: str) -> str:
        if value in ("mlp", "cnn"):
            return value
        module, sep, func = value.partition(":")
        if not sep or not module or not func:
            raise ValueError("must be 'mlp', 'cnn' or 'package.module:function'")
        return value


class Launcher(str, enum.Enum):
    LOCAL = "local"  # worker processes on this machine
    RAY = "ray"  # one Ray actor per task on a Ray cluster


class RayPlacement(str, enum.Enum):
    SPREAD = "spread"  # one task per node (STRICT_SPREAD)
    PACK = "pack"  # as few nodes as fit (PACK)


RAY_ADDRESS_ENV = "RAY_ADDRESS"


class RayConfig(_Frozen):
    """`train.ray`: where the Ray cluster is and what each task reserves on it (used when train.launcher is ray)."""

    address: str | None = None  # None: $RAY_ADDRESS
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    placement: RayPlacement = RayPlacement.SPREAD
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # passed through to every task's actor
    node_ip_address: str | None = None  # this driver's IP as Ray nodes reach it (ray.init's _node_ip_address)
    placement_timeout_s: float = Field(60.0, gt=0.0)

    @field_validator("resources_per_worker")
    @classmethod
    def _known_resources(cls, value: dict[str, float]) -> dict[str, float]:
        negative = {k: v for k, v in value.items() if v < 0}
        if negative:
            raise ValueError(f"resources_per_worker {negative} must be ≥ 0 (CPU, GPU, memory in bytes, or a custom "
                             "resource of your nodes)")
        if not any(v > 0 for v in value.values()):
            raise ValueError(f"resources_per_worker ({value}) reserves nothing; give each task at least one "
                             "resource, e.g. {CPU: 1}")
        return value

    def resolved_address(self, environ: dict[str, str] | None = None) -> str:
        """train.ray.address, else $RAY_ADDRESS.

        Raises:
            ConfigError: when neither is set, naming both.
        """
        environ = os.environ if environ is None else environ
        address = self.address or environ.get(RAY_ADDRESS_ENV, "").strip()
        if not address:
            raise ConfigError("train.launcher is 'ray' but neither train.ray.address nor the RAY_ADDRESS environment "
                              "variable is set; set train.ray.address to the Ray head (e.g. '10.0.0.5:6379' or "
                              "'ray://head:10001') or export RAY_ADDRESS")
        return address


class TrainConfig(_Frozen):
    launcher: Launcher = Launcher.LOCAL
    ray: RayConfig = RayConfig()
    strategy: Strategy = Strategy.AUTO
    cpu_replicas: int | None = Field(None, ge=1)
    workers: int = Field(1, ge=1)
    parameter_servers: int = Field(0, ge=0)
    per_replica_batch_size: int = Field(32, ge=1)
    base_learning_rate: float = Field(1e-3, gt=0.0)
    lr_scaling: LrScaling = LrScaling.LINEAR
    warmup_steps: int = Field(0, ge=0)
    optimizer: Literal["adam", "sgd"] = "adam"
    epochs: int = Field(5, ge=1)
    steps: int | None = Field(None, ge=1)  # total steps; overrides epochs
    steps_per_execution: int = Field(1, ge=1)
    shuffle: bool = True
    autoshard: AutoShard = AutoShard.AUTO
    shuffle_buffer: int = Field(10000, ge=1)
    seed: int = 42
    deterministic: bool = False
    mixed_precision: bool = False
    jit_compile: bool = False  # XLA for the forward and backward pass of the step
    checkpoint_every_steps: int = Field(100, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    log_every_steps: int = Field(50, ge=1)
    communication: Collective = Collective.AUTO
    gradient_pack_mb: float = Field(0.0, ge=0.0)  # 0: TensorFlow's default packing
    hang_timeout_s: float = Field(300.0, gt=0.0)
    max_restarts: int = Field(3, ge=0)
    restart_backoff_s: float = Field(1.0, ge=0.0)
    timeout_s: float | None = Field(None, gt=0.0)
    warm_start_uri: str | None = None

    def uses_parameter_server(self, cluster_has_ps: bool | None = None) -> bool:
        """Whether this run trains under parameter_server: the one rule launcher, worker and strategy share.

        `strategy: parameter_server` always does; `auto` does when there are ps tasks: those TF_CONFIG lists
        (`cluster_has_ps`, once a cluster exists) or, before the launcher starts one, `parameter_servers` > 0.
        """
        has_ps = cluster_has_ps if cluster_has_ps is not None else self.parameter_servers > 0
        return strategy_for_cluster(self.strategy, has_ps=has_ps, num_workers=1) == Strategy.PARAMETER_SERVER

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        if self.parameter_servers and self.strategy not in (Strategy.PARAMETER_SERVER, Strategy.AUTO):
            raise ValueError(
                f"parameter_servers ({self.parameter_servers}) needs strategy 'parameter_server', "
                f"not '{self.strategy.value}'; set train.strategy: parameter_server or parameter_servers: 0"
            )
        if self.strategy == Strategy.PARAMETER_SERVER and self.workers > 1 and self.parameter_servers < 1:
            raise ValueError(
                "strategy 'parameter_server' with workers > 1 needs train.parameter_servers ≥ 1"
            )
        if self.strategy == Strategy.MULTI_WORKER_MIRRORED and self.parameter_servers:
            raise ValueError("strategy 'multi_worker_mirrored' cannot use parameter servers; set parameter_servers: 0")
        return self


class GateConfig(_Frozen):
    metric: str = "accuracy"
    direction: Direction = Direction.MAX
    threshold: float | None = None  # the challenger must reach this to be blessed at all
    min_improvement: float = Field(0.0, ge=0.0)  # over the champion, on `metric`
    # Every slice of `evaluation.slices` with at least `min_slice_examples` examples must reach this on `metric`.
    slice_threshold: float | None = None
    min_slice_examples: int = Field(30, ge=1)


class BucketSlice(_Frozen):
    """Slices of a numeric feature by bucket boundaries: [18, 35, 65] → <18, [18,35), [35,65), ≥65."""

    feature: str
    boundaries: tuple[float, ...] = Field(min_length=1)

    @field_validator("boundaries")
    @classmethod
    def _increasing(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"bucket boundaries {list(value)} must increase strictly, e.g. [18, 35, 65]")
        return value


# A slice: feature keys (one slice per combination of their values) or a bucketed numeric feature.
SliceSpec = tuple[str, ...] | BucketSlice


class EvaluationConfig(_Frozen):
    metrics: tuple[str, ...] = ("loss", "accuracy", "auc")
    select: Literal["best", "latest"] = "best"
    gate: GateConfig = GateConfig()
    # Metrics per slice of the eval split: [["region"], ["region", "device"], {feature: age, boundaries: [18, 35]}].
    slices: tuple[SliceSpec, ...] = ()
    # Retrain-only convenience: the gate's margin, also accepted at this level.
    min_improvement: float | None = Field(None, ge=0.0)

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        allowed = {"loss", "accuracy", "auc", "mae", "rmse", "confusion_matrix"}
        unknown = [m for m in value if m not in allowed]
        if unknown:
            raise ValueError(f"unknown metric(s) {unknown}; allowed: {sorted(allowed)}")
        return value

    @field_validator("slices")
    @classmethod
    def _slice_keys(cls, value: tuple[SliceSpec, ...]) -> tuple[SliceSpec, ...]:
        for spec in value:
            if not isinstance(spec, BucketSlice) and (not spec or len(set(spec)) != len(spec)):
                raise ValueError(f"slice {list(spec)} must name one or more distinct features, e.g. ['region']")
        return value

    @property
    def effective_min_improvement(self) -> float:
        return self.min_improvement if self.min_improvement is not None else self.gate.min_improvement


class TrackingConfig(_Frozen):
    mlflow_uri: str | None = None  # None: sqlite:///<output_root>/mlflow.db
    experiment: str = "tfdag"
    # `register` in the YAML; BaseModel has a `register` attribute, so the field has another name.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, serialize_by_alias=True)

    registered_model: str | None = None
    register_policy: RegisterPolicy = Field(RegisterPolicy.BLESSED, alias="register")
    artifact_location: str | None = None  # fsspec/MLflow artifact root for a new experiment
    enabled: bool = True


class ObservabilityConfig(_Frozen):
    # A Prometheus endpoint on every training task and on the supervisor: 0 = a free port each, null = off.
    prometheus_port: int | None = Field(0, ge=0, le=65535)
    # [start, stop): global steps traced by TensorFlow's profiler on the chief, into the run's TensorBoard directory.
    profile_steps: tuple[int, int] | None = None
    # The profiler server on each task for captures on demand from TensorBoard (null: none).
    profiler_port: int | None = Field(None, ge=1, le=65535)

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"profile_steps {list(value)} must be [start, stop] with 0 ≤ start < stop, e.g. [10, 20]")
        return value


class DriftConfig(_Frozen):  # `validation.drift`: thresholds between this train split and the baseline's
    jensen_shannon: float = Field(0.1, gt=0.0, le=1.0)  # numeric features (base-2 Jensen-Shannon divergence)
    l_infinity: float = Field(0.1, gt=0.0, le=1.0)  # string features (largest change of one value's share)


class ValidationConfig(_Frozen):
    """`validation`: the data check before training, against the statistics of a baseline run."""

    enabled: bool = True
    against: str = "latest"  # latest | champion | an MLflow run id
    drift: DriftConfig = DriftConfig()
    max_missing_rate_increase: float = Field(0.05, ge=0.0, le=1.0)  # absolute, e.g. 0.02 → 0.08 is a jump
    max_unseen_share: float = Field(0.01, ge=0.0, le=1.0)  # rows whose string value the baseline never saw
    allow: tuple[str, ...] = ()  # anomaly names accepted, e.g. "drift:proline" or "unseen_values:*"


class PreflightConfig(_Frozen):
    enabled: bool = True
    timeout_s: float = Field(60.0, gt=0.0)


class PipelineConfig(_Frozen):
    name: str = "pipeline"
    data: DataConfig
    output_root: str = DEFAULT_ROOT
    storage_options: dict[str, Any] = Field(default_factory=dict)  # for output_root
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    tracking: TrackingConfig = TrackingConfig()
    preflight: PreflightConfig = PreflightConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    validation: ValidationConfig = ValidationConfig()

    @property
    def mlflow_uri(self) -> str:
        """The MLflow tracking URI: tracking.mlflow_uri, else $MLFLOW_TRACKING_URI, else a sqlite store in output_root."""
        if self.tracking.mlflow_uri:
            return self.tracking.mlflow_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):  # what `tfdag stack up` gives the worker's flow runs
            return os.environ["MLFLOW_TRACKING_URI"]
        root = self.output_root
        if "://" in root and not root.startswith("file://"):
            root = DEFAULT_ROOT
        root = root.removeprefix("file://")
        return f"sqlite:///{os.path.abspath(os.path.join(root, 'mlflow.db'))}"

    def masked_yaml(self) -> str:
        """The resolved config as YAML with every credential masked (secret-named keys at any depth, and the
        password of a URL such as `http://user:password@host`): safe to log and to store beside a run.
        `${VARIABLE}` references are kept as written, so a rerun resolves them from its own environment."""
        values = self.model_dump(mode="json", by_alias=True)
        masked = mask_secrets(values)
        # Column names, not a credential, though "key" is in the name: a rerun needs them as they were.
        masked["data"]["split"]["key_columns"] = values["data"]["split"]["key_columns"]
        text = yaml.safe_dump(masked, sort_keys=False)
        return mask_url_passwords(text)

    def config_hash(self) -> str:
        """Stable sha256 of the configuration, secrets included only as hashed input."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()


def _format_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The field names allowed at the parent of `loc`, for unknown-key errors."""
    current: Any = model
    for part in loc[:-1]:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    if isinstance(current, type) and issubclass(current, BaseModel):
        return sorted(current.model_fields)
    return None


def format_validation_error(error: ValidationError, source: str) -> str:
    """One line per problem: key path, source, bad value and what is allowed."""
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if not str(p).startswith("function-"))
        path = ".".join(str(p) for p in loc) or "<top level>"
        value = item.get("input")
        kind = item["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(PipelineConfig, loc)
            hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
            lines.append(f"{path} in {source} is not a known key{hint}")
        elif kind == "missing":
            lines.append(f"{path} in {source} is required but missing")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{path} ({_format_value(value)}) in {source}: {msg}")
    return "invalid configuration:\n  - " + "\n  - ".join(lines)


def parse_config(data: dict[str, Any], source: str = "<inline config>") -> PipelineConfig:
    """Validate a mapping into a PipelineConfig.

    Raises:
        ConfigError: naming every bad key path, the source, the value and the fix.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a YAML mapping at the top level, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def load_config(path: str | os.PathLike[str]) -> PipelineConfig:
    """Load one pipeline's YAML file.

    Raises:
        ConfigError: when the file is missing, is not YAML, or holds an invalid value.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a pipeline YAML file")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{file.name} is not valid YAML: {error}") from None
    return parse_config(data if data is not None else {}, source=file.name)


def resolve_config(config: PipelineConfig | dict[str, Any] | str | os.PathLike[str]) -> PipelineConfig:
    """Accept a config object, an inline mapping, a YAML path, or inline YAML text."""
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, dict):
        return parse_config(config)
    text = str(config)
    if "\n" in text or (text.lstrip().startswith("{") and not Path(text).exists()):
        return parse_config(yaml.safe_load(text) or {}, source="<inline YAML>")
    return load_config(text)
