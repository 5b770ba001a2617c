"""The sections around a run: `tracking`, `observability`, `validation` and `preflight`."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from pipeline_lib.config.base import RegisterPolicy, SecretUri, _Frozen


class TrackingConfig(_Frozen):
    mlflow_uri: SecretUri = None  # None: sqlite:///<output_root>/mlflow.db; a password is masked in every dump
    """MLflow tracking URI"""
    experiment: str = "tfdag"
    """experiment name"""
    # `register` in the YAML; BaseModel has a `register` attribute, so the field has another name.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, validate_by_name=True,
                              serialize_by_alias=True)

    registered_model: str | None = None
    """register the exported model under this name"""
    register_policy: RegisterPolicy = Field(RegisterPolicy.BLESSED, alias="register")
    """register: blessed (only a model the gate blessed reaches the registry) or always (every model; one not
    blessed is tagged blessed=false and gets no alias)"""
    artifact_location: str | None = None  # fsspec/MLflow artifact root for a new experiment
    """artifact root for a new experiment (`s3://`, `gs://`, `az://` or MLflow's `wasbs://` form: see Object
    storage)"""
    enabled: bool = True
    """false: no MLflow at all (no run, no model logged or registered)"""


class ObservabilityConfig(_Frozen):
    # A Prometheus endpoint on every training task and on the supervisor: 0 = a free port each, null = off.
    prometheus_port: int | None = Field(0, ge=0, le=65535)
    """a Prometheus endpoint on every training task and on the supervisor (`0`: a free port each; `null`: off);
    see *Watching a run*"""
    # [start, stop): global steps traced by TensorFlow's profiler on the chief, into the run's TensorBoard directory.
    profile_steps: tuple[int, int] | None = None
    """`[start, stop]`: TensorFlow's profiler traces those global steps on the chief into the run's TensorBoard
    directory (`plugins/profile/`); open it with TensorBoard's Profile tab (`pip install 'tfdag[profile]'`)"""
    # The profiler server on each task for captures on demand from TensorBoard (null: none).
    profiler_port: int | None = Field(None, ge=1, le=65535)
    """a profiler server on each task (this port for the first task, +1 for each next one) for captures on demand
    from TensorBoard"""
    # The input wait and the gradient norm measured inside every step (Prometheus, TensorBoard, MLflow): a few small
    # ops per step, which show at small batches; false skips them and reports neither.
    step_metrics: bool = True
    """measure each step's input wait and gradient norm inside the step (Prometheus, TensorBoard, MLflow); a few
    small ops per step that slowed batch-32 training by up to a quarter in an A/B run on a loaded machine;
    `false` skips both"""

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"profile_steps {list(value)} must be [start, stop] with 0 ≤ start < stop, e.g. [10, 20]")
        return value


class DriftConfig(_Frozen):  # `validation.drift`: thresholds between this train split and the baseline's
    jensen_shannon: float = Field(0.1, gt=0.0, le=1.0)  # numeric features (base-2 Jensen-Shannon divergence)
    """drift thresholds: Jensen–Shannon divergence (base 2) of a numeric column over the baseline's deciles;
    L-infinity distance of a string column's value shares"""
    l_infinity: float = Field(0.1, gt=0.0, le=1.0)  # string features (largest change of one value's share)
    """drift thresholds: Jensen–Shannon divergence (base 2) of a numeric column over the baseline's deciles;
    L-infinity distance of a string column's value shares"""


class ValidationConfig(_Frozen):
    """`validation`: the data check before training, against the statistics of a baseline run."""

    enabled: bool = True
    """check the data against a baseline before training (the `validate_data` stage)"""
    against: str = "latest"  # latest | champion | an MLflow run id
    """the baseline: `latest` (the newest FINISHED run of this pipeline that logged statistics), `champion` (the
    run of the registered model's champion) or an MLflow run id"""
    drift: DriftConfig = DriftConfig()
    """Drift thresholds of a feature's distribution against the baseline's"""
    max_missing_rate_increase: float = Field(0.05, ge=0.0, le=1.0)  # absolute, e.g. 0.02 → 0.08 is a jump
    """a column's missing share may rise this much (absolute)"""
    max_unseen_share: float = Field(0.01, ge=0.0, le=1.0)  # rows whose string value the baseline never saw
    """share of a string column's rows that may hold values the baseline never saw"""
    allow: tuple[str, ...] = ()  # anomaly names accepted, e.g. "drift:proline" or "unseen_values:*"
    """anomalies accepted, by name: `drift:proline`, `unseen_values:*`, …"""


class PreflightConfig(_Frozen):
    enabled: bool = True
    """cross-worker preflight before the strategy is built"""
    timeout_s: float = Field(60.0, gt=0.0)
    """cross-worker preflight before the strategy is built"""
