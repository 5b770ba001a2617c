"""Session fixtures on the session's stack (tests/servers.py): one finished, blessed, deterministic digits run that
the tests reading a finished run share (`digits_run`), and the retrain scenario (the digits source, its config and
the first retrain). tests/conftest.py puts the tests using one in one xdist group, so it is made once per session."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline_lib.data import demo as demo_data
from tests.servers import RunningStack, prefect_cli

MODEL_NAME = "digits-retrain-test"
# The digits rows the source starts with; the rest arrive in two later appends.
INITIAL_ROWS = 1400
FIRST_APPEND = 200


# --- the shared digits run -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DigitsRun:
    root: Path  # the run's tmp folder: raw CSV, output_root, the MLflow store
    config: object  # the parsed PipelineConfig
    summary: object  # the PipelineSummary training_pipeline returned


def digits_run_config(tmp_path: Path, **train) -> dict:
    """digits_config's 2 mirrored replicas (scaled batch and learning rate), made deterministic with everything that
    could break that: shuffling, dropout, Adam; `train` overrides."""
    from tests.flows.test_pipeline_flow import digits_config

    config = digits_config(tmp_path, **{"deterministic": True, "shuffle": True, "shuffle_buffer": 500,
                                        "optimizer": "adam", "epochs": DIGITS_RUN_EPOCHS, **train})
    config["model"] = {"factory": "mlp", "params": {"hidden_units": [64], "dropout": 0.2}}
    return config


DIGITS_RUN_EPOCHS = 4


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory, prefect_api) -> DigitsRun:
    """`training_pipeline` once on digits_run_config. Tests that change what the run recorded restore it."""
    from flows.pipeline import training_pipeline
    from pipeline_lib.config import parse_config

    root = tmp_path_factory.mktemp("digits_run")
    config = parse_config(digits_run_config(root))
    return DigitsRun(root=root, config=config, summary=training_pipeline(config))


# --- the retrain scenario -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RetrainScenario:
    running: RunningStack
    config_path: Path
    source: Path
    rows: tuple[str, ...]  # header first, then every digits row
    first: subprocess.CompletedProcess
    # Recorded right after the first retrain, before any test appends rows or retrains: what the first one made
    # (MLflow's runs of the experiment, the source's fingerprint then), so its test holds in any order.
    first_run_ids: tuple[str, ...]
    first_fingerprint: str
    first_champion: str | None  # the version the champion alias named

    def source_fingerprint(self) -> str:
        """The source fingerprint now, as the retrain flow computes it (and the manifest records it)."""
        return _source_fingerprint(self.config_path)

    def append_rows(self, start: int, stop: int) -> None:
        with open(self.source, "a") as handle:
            handle.writelines(self.rows[1 + start:1 + stop])

    def run(self, *extra: str, params: dict | None = None) -> subprocess.CompletedProcess:
        """`prefect deployment run 'retrain/nightly' --watch` on this scenario's config."""
        payload = {"config": str(self.config_path), **(params or {})}
        return prefect_cli(self.running, "deployment", "run", "retrain/nightly", "--watch",
                           "--param", f"params={json.dumps(payload)}", *extra)


def _source_fingerprint(config_path: Path) -> str:
    from pipeline_lib.config import load_config
    from pipeline_lib.data.sources import source_fingerprint

    return source_fingerprint(load_config(config_path).data).sha256


def _digits_rows() -> tuple[str, ...]:
    text = demo_data.digits_csv_bytes().decode()
    return tuple(line + "\n" for line in text.splitlines())


@pytest.fixture(scope="session")
def retrain_scenario(tfdag_stack, tmp_path_factory) -> RetrainScenario:
    """The digits source with its first rows, a short-training config, and the first retrain (which promotes)."""
    work = tmp_path_factory.mktemp("retrain")
    rows = _digits_rows()
    source = work / "raw" / "digits-source.csv"
    source.parent.mkdir(parents=True)
    source.write_text("".join(rows[:1 + INITIAL_ROWS]))
    config = {
        "name": "digits-retrain",
        "data": {"source": str(source), "format": "csv", "label": "target", "target_shard_mb": 0.25},
        "output_root": str(work / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [64]}},
        # Trained in the flow-run's own process (isolation none, no worker process importing TensorFlow again): the
        # scenario is about promoting, skipping and refusing; the worker process is test_pipeline_flow.py's.
        "train": {"strategy": "default", "isolation": "none", "per_replica_batch_size": 32,
                  "base_learning_rate": 0.003, "epochs": 1, "checkpoint_every_steps": 20, "log_every_steps": 10,
                  "seed": 3},
        # No model check (a fresh interpreter importing TensorFlow and MLflow, about 8 CPU-s a run): nothing of the
        # scenario asserts it, and the retrain flow trains through the same run_pipeline as digits_run, which keeps it.
        "evaluation": {"metrics": ["loss", "accuracy", "auc"],
                       "gate": {"metric": "accuracy", "direction": "max", "threshold": None},
                       "min_improvement": 0.0, "validate_model": False},
        # No tracking.mlflow_uri: flow runs use the stack's MLflow server (MLFLOW_TRACKING_URI of the worker).
        "tracking": {"experiment": "digits-retrain", "registered_model": MODEL_NAME},
    }
    config_path = work / "digits-retrain.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    # Through the Prefect profile `stack up` activated: no PREFECT_API_URL in this CLI's environment.
    payload = json.dumps({"config": str(config_path)})
    first = prefect_cli(tfdag_stack, "deployment", "run", "retrain/nightly", "--watch", "--param",
                        f"params={payload}", api_url=False)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tfdag_stack.state.mlflow_url, registry_uri=tfdag_stack.state.mlflow_url)
    experiment = client.get_experiment_by_name("digits-retrain")
    run_ids = tuple(r.info.run_id for r in client.search_runs([experiment.experiment_id])) if experiment else ()
    try:
        champion = client.get_model_version_by_alias(MODEL_NAME, "champion").version
    except Exception:  # noqa: BLE001 - no such model or alias: the first retrain's test says what went wrong
        champion = None
    return RetrainScenario(running=tfdag_stack, config_path=config_path, source=source, rows=rows, first=first,
                           first_run_ids=run_ids, first_fingerprint=_source_fingerprint(config_path),
                           first_champion=champion)


def worker_log_tail(running: RunningStack, num_chars: int = 6000) -> str:
    path = running.root / "stack" / "logs" / "worker.log"
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no worker log)"

