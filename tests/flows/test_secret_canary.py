"""No secret is ever stored: a canary secret, in the environment and written literally in the config, through a
local 2-worker pipeline run on S3 (moto) with a password in the MLflow tracking URI, then searched for in every
output — Prefect's flow run, task runs, logs, artifacts and events (through its API), MLflow's params, tags,
metrics and every artifact file, every object on the store (run directory, checkpoints, TensorBoard events, worker
logs), both servers' own files, the output of a `tfdag` command, and temp files left behind.

moto checks no signature, so a secret key and a session token that hold the canary are accepted; the canary also
reaches the data's storage options through a `${VARIABLE}` reference.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from pipeline_lib.config import parse_config
from pipeline_lib.core.secrets import MASK
from pipeline_lib.data import demo as demo_data
from pipeline_lib.tracking import reproducibility
from tests.canary import Canary, search_mlflow, search_prefect, temp_entries
from tests.stores.conftest import ACCESS_KEY, BUCKET, s3, s3_server  # noqa: F401 - the S3 fixtures

ROOT = Path(__file__).resolve().parents[2]
ENV_NAME = "TFDAG_TEST_CANARY_SECRET"


def canary_config(canary: Canary, mlflow_url: str, name: str, **train) -> dict:
    """The digits pipeline on S3 with the canary as a literal secret key and session token of output_root's storage
    options, as a `${VARIABLE}` reference in the data's, and as the password of the tracking URI."""
    host = mlflow_url.split("://", 1)[1]
    return {
        "name": name,
        "data": {"source": f"s3://{BUCKET}/raw/digits.csv", "label": "target", "target_shard_mb": 0.1,
                 "storage_options": {"key": ACCESS_KEY, "secret": f"${{{ENV_NAME}}}"}},
        "output_root": f"s3://{BUCKET}/tfdag",
        "storage_options": {"key": ACCESS_KEY, "secret": canary.value, "token": canary.value},
        "model": {"factory": "mlp", "params": {"hidden_units": [32]}},
        "train": {"strategy": "multi_worker_mirrored", "workers": 2, "per_replica_batch_size": 32,
                  "steps": 12, "checkpoint_every_steps": 6, "log_every_steps": 3, "lr_scaling": "none",
                  "hang_timeout_s": 120, "max_restarts": 0, **train},
        "evaluation": {"metrics": ["loss", "accuracy"]},
        "tracking": {"mlflow_uri": f"http://tfdag:{canary.value}@{host}", "experiment": name,
                     "registered_model": name, "register": "always"},
    }


def assert_masked_config(values: dict, where: str) -> None:
    """A config as stored (a Prefect parameter, MLflow's config artifact) shows the mask or the reference."""
    assert values["storage_options"]["secret"] == MASK and values["storage_options"]["token"] == MASK, where
    assert values["data"]["storage_options"]["secret"] == f"${{{ENV_NAME}}}", where
    assert values["tracking"]["mlflow_uri"].startswith(f"http://tfdag:{MASK}@"), where


def run_and_search(canary: Canary, values: dict, store, stack, tmp_path: Path, monkeypatch, caplog,
                   extra_dirs: dict[str, str] | None = None) -> None:
    """Run `tfdag convert` and then the training-pipeline flow (the config itself its parameter) on `values`, and
    search every output for the canary; fails naming every place it was found.

    Args:
        extra_dirs: more directories to search, by name (a Ray cluster's session logs, say).
    """
    import logging
    import time

    from mlflow import MlflowClient
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    from flows.pipeline import training_pipeline

    caplog.set_level(logging.INFO)
    monkeypatch.setenv(ENV_NAME, canary.value)
    # The run's own temp files (the flow's and the workers', who inherit TMPDIR) land here; the system temp
    # directory is compared before and after for anything else.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    before = temp_entries()
    started = time.time()

    config_path = tmp_path / "input" / "canary.yaml"  # the user's input: the one file that holds the canary
    config_path.parent.mkdir()
    config_path.write_text(yaml.safe_dump(values))
    config = parse_config(values, source=config_path.name)
    demo_data.write_digits_csv(config.data.source, config.data.storage_options)

    # A `tfdag` command on the file: its output shows no secret.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    convert = subprocess.run([sys.executable, "-m", "flows.cli", "convert", str(config_path)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert convert.returncode == 0, (convert.stdout + convert.stderr)[-3000:]
    canary.text("stdout of `tfdag convert`", convert.stdout)
    canary.text("stderr of `tfdag convert`", convert.stderr)

    # The config itself is the flow's parameter: the literal secret stays in this process.
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        summary = training_pipeline(config)
    assert summary.num_workers == 2 and summary.final_step == values["train"]["steps"]
    assert summary.model_version is not None
    canary.text("stdout of the flow (worker output included)", out.getvalue())
    canary.text("stderr of the flow", err.getvalue())
    canary.text("log records of the flow process", caplog.text)
    canary.json("the flow's summary", summary.model_dump(mode="json"))

    mlflow_url = stack.state.mlflow_url
    flow_run_id = MlflowClient(tracking_uri=mlflow_url).get_run(summary.mlflow_run_id).data.tags["prefect_flow_run_id"]
    parameters = search_prefect(canary, flow_run_id)
    assert_masked_config(parameters["config"], "the Prefect flow run's parameters")

    downloaded = search_mlflow(canary, mlflow_url, summary.mlflow_run_id, tmp_path / "mlflow")
    logged = yaml.safe_load((Path(downloaded["artifacts"]) / reproducibility.CONFIG_ARTIFACT).read_text())
    assert_masked_config(logged, "MLflow's config artifact")

    # Every object on the store: data, run directory, checkpoints, TensorBoard events, worker logs, exports.
    assert canary.store("S3 object", store.fs, BUCKET) > 10
    run_keys = store.keys("tfdag/runs")
    for part in ("/checkpoints/", "/tensorboard/", "/logs/", "/export/"):
        assert any(part in key for key in run_keys), (part, run_keys)
    # Both servers' own files: Prefect's database, MLflow's database and artifact store, their logs.
    canary.directory("the stack's files", stack.root)
    # Temp files: the run's own (flow and workers), and anything new in the system temp directory.
    canary.directory("temp file of the run", private_tmp)
    for entry in sorted(temp_entries() - before):
        if os.path.isdir(entry):
            canary.directory("new temp entry", entry)
        elif os.path.isfile(entry):
            canary.text(f"new temp file {entry}", Path(entry).read_bytes())
    # Prefect's local result storage of this process (results it persisted during the run).
    results = Path(PREFECT_LOCAL_STORAGE_PATH.value())
    if results.is_dir():
        canary.directory("Prefect local result", results, since=started)
    for name, directory in (extra_dirs or {}).items():
        canary.directory(name, directory, since=started)
    # Everything else the test itself wrote, but for the user's input file.
    canary.directory("the test's directory", tmp_path, skip=(str(config_path),))

    assert not canary.hits, canary.report()


@pytest.mark.slow
def test_no_output_of_a_local_two_worker_s3_run_holds_the_canary(s3, tfdag_stack, prefect_api, tmp_path,  # noqa: F811
                                                                  monkeypatch, caplog):
    canary = Canary()
    values = canary_config(canary, tfdag_stack.state.mlflow_url, f"canary-{tmp_path.name}")
    run_and_search(canary, values, s3, tfdag_stack, tmp_path, monkeypatch, caplog)


@pytest.mark.parametrize("form", ["inline YAML", "dict", "retrain override"])
def test_an_inline_config_with_a_literal_secret_is_refused_before_any_stage_and_its_record_masked(
        form, tfdag_stack, prefect_api, tmp_path):
    """Prefect records an inline config (YAML text, a mapping) or a retrain override as given, before any flow code
    runs: the flow refuses it in one line naming the keys, replaces the recorded parameter by its masked form, and
    starts no task. Then the run's parameters, task runs, logs, artifacts and events hold no canary."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import training_pipeline
    from flows.retrain import RetrainParameters, retrain
    from pipeline_lib.config import ConfigError

    canary = Canary()
    values = canary_config(canary, tfdag_stack.state.mlflow_url, f"refused-{tmp_path.name}")
    if form == "retrain override":
        config_path = tmp_path / "no-secret.yaml"  # a path: only the path is recorded
        config_path.write_text(yaml.safe_dump({**values, "storage_options": {}, "tracking": {
            "mlflow_uri": tfdag_stack.state.mlflow_url, "registered_model": "refused"}}))
        params = RetrainParameters(config=str(config_path), overrides={"storage_options.secret": canary.value})
        state = retrain(params, return_state=True)
        expected = "params.overrides holds a literal secret at storage_options.secret: "
    else:
        state = training_pipeline(yaml.safe_dump(values) if form == "inline YAML" else values, return_state=True)
        # the access key id too: `key` is a secret name, masked in every dump like the secret key
        expected = ("config holds a literal secret at data.storage_options.key, storage_options.key, "
                    "storage_options.secret, storage_options.token, tracking.mlflow_uri: ")
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigError), error
    message = str(error)
    assert message.startswith(expected) and "\n" not in message, message
    assert "the recorded copy was replaced by its masked form" in message and "${prefect-secret:" in message

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    assert task_runs == [], [t.name for t in task_runs]  # refused before any stage
    parameters = search_prefect(canary, str(flow_run_id))
    assert not canary.hits, canary.report()
    if form == "retrain override":
        assert parameters["params"]["overrides"] == {"storage_options.secret": MASK}
        assert parameters["params"]["config"] == str(config_path)
    else:
        recorded = parameters["config"]
        assert_masked_config(yaml.safe_load(recorded) if form == "inline YAML" else recorded, "the recorded parameter")
