"""`tfdag predict` and the `batch-predict` flow: which model scores which table, and where the predictions go."""

from __future__ import annotations

import enum

from pydantic import Field, field_validator

from pipeline_lib.config.base import (
    DataEngine,
    DataFormat,
    OnBadRecord,
    SecretSettings,
    SecretUri,
    _Frozen,
)
from pipeline_lib.config.csv import CsvOptions
from pipeline_lib.config.ray import RayConfig, checked_resources

# Rows per chunk: each chunk is read, converted and scored in one call of the model, and is the unit that bounds
# memory (two chunks in flight: one read ahead, one scored; one written).
DEFAULT_BATCH_ROWS = 4096


class OutputFormat(str, enum.Enum):
    PARQUET = "parquet"
    CSV = "csv"


class RayScoring(_Frozen):
    """`engine: ray`: the Ray cluster that scores, and what each of its scoring actors asks of a node."""

    address: str | None = Field(None, description="The Ray head's address, host:port (default: $RAY_ADDRESS)")
    node_ip_address: str | None = Field(None, description="This driver's IP as the Ray nodes reach it")
    resources_per_actor: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="What each scoring actor asks of a node: CPU, GPU, memory in bytes, or a custom resource")
    actors: int | None = Field(None, ge=1, description="Scoring actors, each holding the model (default: as many "
                                                       "as the cluster's nodes hold, at most one per input part)")

    @field_validator("resources_per_actor")
    @classmethod
    def _known_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return checked_resources("ray.resources_per_actor", value)

    def cluster(self) -> RayConfig:
        """The cluster's address as training's section names it (what `connect` takes)."""
        return RayConfig(address=self.address, node_ip_address=self.node_ip_address)


class PredictConfig(CsvOptions):
    """One batch-scoring run: MODEL on every row of INPUT, predictions (and the kept columns) to OUTPUT.

    `model`: an export directory (local or any fsspec URI: `saved_model/` and `export_manifest.json`) or an MLflow
    model URI (`models:/name@alias`, `models:/name/3`, `models:/m-…`, `runs:/<run id>/model`).
    """

    model: str = Field(description="models:/name@alias, models:/name/N, runs:/<run id>/model, or an export directory")
    input: str = Field(description="The table to score: a file, directory or glob (any fsspec URL) of CSV, Parquet "
                                   "or JSON Lines")
    output: str = Field(description="Where the predictions go (any fsspec URL), written whole or not at all")
    keep: tuple[str, ...] = Field((), description="Input columns copied to the output beside the predictions, "
                                                  "e.g. an id")
    output_format: OutputFormat | None = Field(None, description="parquet or csv (default: by OUTPUT's extension)")
    input_format: DataFormat = Field(DataFormat.AUTO, description="The input's format (default: by extension)")
    batch_rows: int = Field(DEFAULT_BATCH_ROWS, ge=1, description="Rows per chunk and per call of the model: "
                                                                  "what bounds memory")
    on_bad_record: OnBadRecord = Field(OnBadRecord.FAIL, description="fail: stop at the first bad row, naming it; "
                                                                     "skip: drop bad rows and count them")
    tracking_uri: SecretUri = Field(None, description="The MLflow store of a models:/ or runs:/ URI (default: "
                                                      "$MLFLOW_TRACKING_URI)")
    storage_options: SecretSettings = Field(default_factory=dict, description="fsspec options of the input, the "
                                            "output and an export directory; secrets as ${VARIABLE} references")
    engine: DataEngine = Field(DataEngine.LOCAL, description="local: score in this process into one file; ray: "
                                                             "score the input's files and row groups on a Ray "
                                                             "cluster into a directory of parts")
    ray: RayScoring = Field(default_factory=RayScoring, description="engine ray: the cluster and its actors")

    @field_validator("keep")
    @classmethod
    def _unique(cls, keep: tuple[str, ...]) -> tuple[str, ...]:
        repeated = sorted({name for name in keep if keep.count(name) > 1})
        if repeated:
            raise ValueError(f"keep names {repeated} more than once; name each column once")
        return keep
