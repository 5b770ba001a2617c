"""Shared set-up of the tracking tests: no ambient MLflow store, a config whose storage options hold secrets."""

from __future__ import annotations

import pytest

from pipeline_lib.config import PipelineConfig, parse_config

SECRET = "s3cr3t-value-123"
ACCESS_KEY = "AKIAEXAMPLEKEY0042"


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def tracking_config(tmp_path, **tracking_section) -> PipelineConfig:
    """A config with credentials in its storage options (they must never reach MLflow) and a sqlite store."""
    options = {"secret": SECRET, "key": ACCESS_KEY}
    return parse_config({
        "name": "demo",
        "data": {"source": "s3://bucket/raw/*.csv", "label": "label", "storage_options": options},
        "output_root": str(tmp_path / "root"),
        "storage_options": options,
        "model": {"params": {"hidden_units": [8]}},
        "train": {"per_replica_batch_size": 16, "base_learning_rate": 0.001},
        "tracking": {"experiment": "exp", "registered_model": "tiny", **tracking_section},
    })
