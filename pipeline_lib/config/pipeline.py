"""`PipelineConfig` (every section) and loading it: from YAML, a dict or a path, with errors that name the key,
the value, where it came from and the fix."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    SerializationInfo,
    ValidationError,
    model_serializer,
    model_validator,
)

from pipeline_lib.config.base import DEFAULT_ROOT, ConfigError, SecretSettings, _Frozen
from pipeline_lib.config.data import DataConfig
from pipeline_lib.config.evaluation import EvaluationConfig
from pipeline_lib.config.run import (
    ObservabilityConfig,
    PreflightConfig,
    TrackingConfig,
    ValidationConfig,
)
from pipeline_lib.config.train import ModelConfig, TrainConfig
from pipeline_lib.config.tune import TrialBinding, TuneConfig
from pipeline_lib.config.tune_space import check_tune
from pipeline_lib.core import storage
from pipeline_lib.core.secrets import SecretEnv, mask_url_passwords, secrets_context

# The keys a resumed run may change (`tfdag run --resume`): how training is supervised, not what it trains. They
# are neither MLflow params nor part of config_hash.
RESUME_SAFE_KEYS = ("train.max_restarts", "train.restart_backoff_s", "train.hang_timeout_s", "train.timeout_s")


class PipelineConfig(_Frozen):
    name: str = "pipeline"
    """pipeline name: run names, artifact keys"""
    data: DataConfig
    """The source table, its conversion to TFRecords and its train/eval split, and what a missing value does"""
    output_root: str = DEFAULT_ROOT
    """fsspec URI for TFRecords (`data/<fingerprint>/`), runs (`runs/<run>/`) and the default MLflow store"""
    storage_options: SecretSettings = Field(default_factory=dict)  # for output_root; secrets masked in every dump
    """fsspec options for `output_root` (endpoint, profile, anon…)"""
    model: ModelConfig = ModelConfig()
    """The model the factory builds, and its task"""
    train: TrainConfig = TrainConfig()
    """How training runs: launcher, strategy, batch and learning-rate scaling, steps, checkpoints and faults"""
    evaluation: EvaluationConfig = EvaluationConfig()
    """The metrics of the exported model on the eval split, its slices, and the gate that blesses it"""
    tracking: TrackingConfig = TrackingConfig()
    """The MLflow store, experiment and registered model; whether a run is tracked at all"""
    preflight: PreflightConfig = PreflightConfig()
    """The cross-worker check every worker runs before training"""
    observability: ObservabilityConfig = ObservabilityConfig()
    """Prometheus metrics, profiling and the per-step metrics of the workers"""
    validation: ValidationConfig = ValidationConfig()
    """The data check against a baseline run's statistics before training"""
    tune: TuneConfig | None = None  # a hyperparameter search (`tfdag tune`); None: no search
    """a hyperparameter search (`tfdag tune`); None: no search"""
    # Set by the tuning runner (`tuning.runner`) in each trial's config, never by a user: where the trial's chief
    # reports its evaluations.
    tune_trial: TrialBinding | None = None
    """Set by the tuning runner (`tuning.runner`) in each trial's config, never by a user: where the trial's
    chief reports its evaluations."""

    @model_validator(mode="after")
    def _task_defaults_and_rules(self) -> PipelineConfig:
        # The evaluation keys a config leaves out follow model.task (`config.evaluation.TASK_METRICS`); they stay
        # "left out" in model_fields_set and in every dump, so a dump loaded after a task override derives them anew.
        evaluation = self.evaluation.for_task(self.model.task)
        if evaluation is not self.evaluation:
            object.__setattr__(self, "evaluation", evaluation)  # frozen: set once, here, while validating
        self.train.early_stopping.check_metric(self.model.task)
        if self.tune is not None or self.tune_trial is not None:
            check_tune(self)  # the space against this config: every path and every end of every range
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any, info: SerializationInfo) -> dict[str, Any]:
        # A config without a search dumps (and hashes) as it did before `tune` existed.
        data = handler(self)
        for key in ("tune", "tune_trial"):
            if data.get(key, False) is None:
                del data[key]
        return data

    @property
    def mlflow_uri(self) -> str:
        """The MLflow tracking URI: tracking.mlflow_uri, else $MLFLOW_TRACKING_URI, else a sqlite store in output_root.

        `${NAME}` references in tracking.mlflow_uri (`http://user:${MLFLOW_PASSWORD}@host`) are resolved here, in
        the process that opens the store; show it with `mlflow_uri_shown`, never as it is.
        """
        if self.tracking.mlflow_uri:
            return storage.expand_env(self.tracking.mlflow_uri, "tracking.mlflow_uri")
        if os.environ.get("MLFLOW_TRACKING_URI"):  # what `tfdag stack up` gives the worker's flow runs
            return os.environ["MLFLOW_TRACKING_URI"]
        root = self.output_root
        if "://" in root and not root.startswith("file://"):
            root = DEFAULT_ROOT
        root = root.removeprefix("file://")
        return f"sqlite:///{os.path.abspath(os.path.join(root, 'mlflow.db'))}"

    @property
    def mlflow_uri_shown(self) -> str:
        """`mlflow_uri` as a log line, a message or a summary may show it: its password masked."""
        return mask_url_passwords(self.mlflow_uri)

    def masked_yaml(self) -> str:
        """The config as YAML, every credential masked by the one serializer of the config's credential fields
        (storage options, tracking.mlflow_uri's password, train.ray.runtime_env): safe to log and to store beside a
        run. `${VARIABLE}` references are kept as written, so a rerun resolves them from its own environment."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)

    def for_process(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The config as another process of this run gets it (a worker's spec) and the environment it needs.

        Each literal secret becomes a `${TFDAG_SECRET_…}` reference in the values and a variable of the returned
        environment: a launcher puts that environment in the process's own (a child's env; on Ray, through the
        in-memory call that starts the task's worker), never in a file or a parameter. A `${VARIABLE}` reference
        stays as it is (the process reads its own environment); a `${SCHEME:NAME}` reference to a store's secret (a
        Prefect Secret block) is resolved here, where its resolver is registered, and moved like a literal secret.

        Returns:
            (the JSON-ready values, {variable: secret}).
        """
        env = SecretEnv()
        values = self.model_dump(mode="json", by_alias=True, context=secrets_context(env))
        return values, env.env

    def literal_secrets(self) -> list[str]:
        """The key paths of the credentials written as values, e.g. `storage_options.secret` or
        `tracking.mlflow_uri` (its password): what every dump masks. A `${VARIABLE}` or `${prefect-secret:NAME}`
        reference is none (and is not resolved here)."""
        env = SecretEnv(resolve_stores=False)
        values = self.model_dump(mode="json", by_alias=True, context=secrets_context(env))
        references = [f"${{{name}}}" for name in env.env]
        return [where for where, value in _leaves(values) if isinstance(value, str)
                and any(reference in value for reference in references)]

    def revealed(self) -> dict[str, Any]:
        """The values with every literal secret as it is: only to validate a changed copy in this process
        (never to write, log or pass on)."""
        return self.model_dump(mode="json", by_alias=True, context=secrets_context(reveal=True))

    def config_hash(self) -> str:
        """Stable sha256 of the configuration as it is shown: a literal secret enters masked, a `${NAME}` reference
        as written, so the hash holds nothing of a credential. The RESUME_SAFE_KEYS are left out."""
        shown = self.model_dump(mode="json")
        for key in RESUME_SAFE_KEYS:
            section, name = key.split(".")
            shown[section].pop(name, None)
        return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()

    def changed_keys(self, recorded: Mapping[str, Any]) -> list[str]:
        """The key paths whose values differ from `recorded` (the `model_dump(mode="json")` of an earlier config,
        credentials masked on both sides), RESUME_SAFE_KEYS left out."""
        now, before = dict(_leaves(self.model_dump(mode="json"))), dict(_leaves(recorded))
        missing = object()
        return sorted(key for key in now.keys() | before.keys()
                      if key not in RESUME_SAFE_KEYS and now.get(key, missing) != before.get(key, missing))


def _leaves(value: Any, where: str = "") -> list[tuple[str, Any]]:
    """(key path, value) of every leaf of JSON-like values: `a.b`, `a.list[0]`."""
    if isinstance(value, Mapping):
        return [leaf for key, item in value.items() for leaf in _leaves(item, f"{where}.{key}" if where else str(key))]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, f"{where}[{i}]")]
    return [(where, value)]


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
        elif not loc:  # a rule across sections: its message names the keys
            lines.append(f"{item['msg'].removeprefix('Value error, ')} (in {source})")
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


def is_inline(config: Any) -> bool:
    """True for a config given as its content, a mapping or YAML text, rather than a YAML file's path or a
    PipelineConfig: whoever records the argument (Prefect, as a flow run's parameter) records the content as it is."""
    if isinstance(config, PipelineConfig):
        return False
    if isinstance(config, Mapping):
        return True
    text = str(config)
    return "\n" in text or (text.lstrip().startswith("{") and not Path(text).exists())


def resolve_config(config: PipelineConfig | dict[str, Any] | str | os.PathLike[str]) -> PipelineConfig:
    """Accept a config object, an inline mapping, a YAML path, or inline YAML text."""
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, Mapping):
        return parse_config(dict(config))
    if is_inline(config):
        return parse_config(yaml.safe_load(str(config)) or {}, source="<inline YAML>")
    return load_config(str(config))
