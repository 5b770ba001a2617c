"""Pipeline configuration: frozen pydantic models loaded from one YAML file per pipeline.

One module per concern: `base` (the error, enums and shared rules), `data`, `train`, `ray` (the Ray launcher's
section of `train`), `evaluation`, `run` (tracking, observability, validation, preflight), `tune` (the search space
and a trial's binding to its study), `tune_space` (a space against the config it tunes) and `pipeline`
(`PipelineConfig` and loading it). Everything is imported from here: `from pipeline_lib.config import PipelineConfig`.
"""

from pipeline_lib.config.base import (  # noqa: F401
    DEFAULT_ROOT,
    LOWER_IS_BETTER_METRICS,
    AutoShard,
    Collective,
    Compression,
    ConfigError,
    DataEngine,
    DataFormat,
    Direction,
    ImputeWith,
    LrScaling,
    MissingPolicy,
    OnBadRecord,
    RegisterPolicy,
    Strategy,
    Task,
    metric_direction,
    strategy_for_cluster,
)
from pipeline_lib.config.data import (  # noqa: F401
    ColumnMissing,
    ColumnMissingConfig,
    DataConfig,
    SplitConfig,
)
from pipeline_lib.config.evaluation import (  # noqa: F401
    BucketSlice,
    EvaluationConfig,
    GateConfig,
    SliceSpec,
)
from pipeline_lib.config.pipeline import (  # noqa: F401
    RESUME_SAFE_KEYS,
    PipelineConfig,
    format_validation_error,
    load_config,
    parse_config,
    resolve_config,
)
from pipeline_lib.config.predict import (  # noqa: F401
    DEFAULT_BATCH_ROWS,
    OutputFormat,
    PredictConfig,
    RayScoring,
)
from pipeline_lib.config.ray import (  # noqa: F401
    RAY_ADDRESS_ENV,
    RayConfig,
    RayPlacement,
)
from pipeline_lib.config.run import (  # noqa: F401
    DriftConfig,
    ObservabilityConfig,
    PreflightConfig,
    TrackingConfig,
    ValidationConfig,
)
from pipeline_lib.config.train import (  # noqa: F401
    CHECKPOINT_EVAL_METRICS,
    EarlyStoppingConfig,
    ElasticConfig,
    Isolation,
    Launcher,
    ModelConfig,
    TrainConfig,
)
from pipeline_lib.config.tune import (  # noqa: F401
    Choice,
    Distribution,
    IntRange,
    LogUniform,
    Pruner,
    Sampler,
    TrialBinding,
    TuneConfig,
    Uniform,
    choice_key,
)
