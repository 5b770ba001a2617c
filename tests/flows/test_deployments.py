"""deployments/prefect.yaml: valid for Prefect 3.9, and deployed by `tfdag stack up` onto a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import stack
from tests.servers import ROOT, prefect_cli

PREFECT_YAML = ROOT / "deployments" / "prefect.yaml"
K8S_TEMPLATE = ROOT / "deployments" / "k8s-work-pool.yaml"


def _load(path: Path):
    from prefect.cli.deploy._models import PrefectYamlModel

    return PrefectYamlModel.model_validate(yaml.safe_load(path.read_text()))


def _deployment(model, name: str):
    return next(d for d in model.deployments if d.name == name)


def test_prefect_yaml_declares_the_deployments_on_the_process_pool():
    model = _load(PREFECT_YAML)
    assert sorted(d.name for d in model.deployments) == ["champion", "manual", "nightly", "weekly"]
    for deployment in model.deployments:
        assert deployment.work_pool.name == "tfdag-local"
        assert deployment.enforce_parameter_schema is True
    nightly = _deployment(model, "nightly")
    assert nightly.entrypoint == "flows/retrain.py:retrain"
    assert [(s.cron, s.timezone) for s in nightly.schedules] == [("0 3 * * *", "UTC")]
    assert (nightly.concurrency_limit.limit, nightly.concurrency_limit.collision_strategy) == (1, "ENQUEUE")
    assert _deployment(model, "manual").entrypoint == "flows/pipeline.py:training_pipeline"
    scoring = _deployment(model, "champion")
    assert scoring.entrypoint == "flows/batch_predict.py:batch_predict"
    assert scoring.parameters["params"]["model"].endswith("@champion")
    # An hour after the nightly retrain: it scores with the champion that run left.
    assert [(s.cron, s.timezone) for s in scoring.schedules] == [("0 4 * * *", "UTC")]
    tune = _deployment(model, "weekly")
    assert tune.entrypoint == "flows/tune.py:tune_pipeline"
    assert [(s.cron, s.timezone) for s in tune.schedules] == [("0 5 * * 0", "UTC")]
    assert (ROOT / tune.parameters["config"]).is_file()
    # No clone or pull: the process worker runs flows in the directory `prefect deploy` ran in.
    steps = [next(iter(step)) for step in model.pull]
    assert steps == ["prefect.deployments.steps.set_working_directory"]


def test_deployment_parameters_validate_against_the_flows_schemas():
    """What enforce_parameter_schema checks: the YAML's parameters fit the pydantic-typed flow signatures."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    model = _load(PREFECT_YAML)
    schemas = {}
    for deployment in model.deployments:
        flow = load_flow_from_entrypoint(str(ROOT / deployment.entrypoint))
        schema = parameter_schema(flow).model_dump_for_openapi()
        validate(deployment.parameters, schema, raise_on_error=True, ignore_required=True)
        schemas[deployment.name] = schema
    retrain = schemas["nightly"]["definitions"]["RetrainParameters"]
    assert set(retrain["properties"]) == {"config", "overrides", "warm_start", "force"}
    assert retrain["additionalProperties"] is False  # a misspelt field is refused, not ignored
    assert (ROOT / _deployment(model, "nightly").parameters["params"]["config"]).is_file()
    scoring = schemas["champion"]["definitions"]["PredictConfig"]
    assert {"model", "input", "output", "keep", "on_bad_record", "storage_options"} <= set(scoring["properties"])
    assert scoring["additionalProperties"] is False


def test_k8s_template_uncommented_is_a_valid_prefect_yaml():
    lines = K8S_TEMPLATE.read_text().splitlines()
    body = lines[lines.index("# name: tfdag"):]
    assert all(line.startswith("#") for line in body), "the template stays commented out"
    model = _load_text("\n".join(line[2:] if line.startswith("# ") else line[1:] for line in body))
    assert sorted(d.name for d in model.deployments) == ["manual", "nightly"]
    assert all(d.work_pool.name == "tfdag-k8s" for d in model.deployments)
    assert all(d.work_pool.job_variables["image"].startswith("<registry>") for d in model.deployments)
    nightly = _deployment(model, "nightly")
    assert (nightly.concurrency_limit.limit, nightly.concurrency_limit.collision_strategy) == (1, "ENQUEUE")


def _load_text(text: str):
    from prefect.cli.deploy._models import PrefectYamlModel

    return PrefectYamlModel.model_validate(yaml.safe_load(text))


@pytest.mark.slow
def test_stack_deploys_every_deployment_to_the_server(tfdag_stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (temporary_settings(updates={PREFECT_API_URL: tfdag_stack.state.prefect_api_url}),
          get_client(sync_client=True) as client):
        nightly = client.read_deployment_by_name("retrain/nightly")
        manual = client.read_deployment_by_name("training-pipeline/manual")
        scoring = client.read_deployment_by_name("batch-predict/champion")
        tune = client.read_deployment_by_name("tune-pipeline/weekly")
        pool = client.read_work_pool("tfdag-local")
    assert pool.type == "process"
    assert sorted(tfdag_stack.state.deployments) == ["batch-predict/champion", "retrain/nightly",
                                                     "training-pipeline/manual", "tune-pipeline/weekly"]
    for deployment in (nightly, manual, scoring, tune):
        assert deployment.work_pool_name == "tfdag-local"
        assert deployment.enforce_parameter_schema is True
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert [(s.schedule.cron, s.schedule.timezone) for s in nightly.schedules] == [("0 3 * * *", "UTC")]
    assert nightly.global_concurrency_limit.limit == 1
    assert nightly.concurrency_options.collision_strategy.value == "ENQUEUE"
    assert "RetrainParameters" in json.dumps(nightly.parameter_openapi_schema)
    assert [(s.schedule.cron, s.schedule.timezone) for s in scoring.schedules] == [("0 4 * * *", "UTC")]
    assert "PredictConfig" in json.dumps(scoring.parameter_openapi_schema)
    assert [(s.schedule.cron, s.schedule.timezone) for s in tune.schedules] == [("0 5 * * 0", "UTC")]


@pytest.mark.slow
def test_the_server_rejects_parameters_outside_the_schema(tfdag_stack):
    out = prefect_cli(tfdag_stack, "deployment", "run", "retrain/nightly",
                      "--param", 'params={"config": "examples/digits.yaml", "epochz": 3}', timeout=120)
    assert out.returncode != 0
    assert "epochz" in out.stdout + out.stderr


@pytest.mark.slow
def test_stack_status_reports_every_service_running(tfdag_stack):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "stack", "status", "--root", str(tfdag_stack.root)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    for record in tfdag_stack.state.services:
        assert f"pid {record.pid}" in out.stdout
        assert stack.find_process(record) is not None
    assert tfdag_stack.state.mlflow_url in out.stdout and tfdag_stack.state.prefect_ui_url in out.stdout
    # The Prefect profile `up` activated is what a plain `prefect` in the user's shell talks to.
    view = prefect_cli(tfdag_stack, "config", "view", api_url=False, timeout=120)
    assert f"PREFECT_API_URL='{tfdag_stack.state.prefect_api_url}'" in view.stdout


@pytest.mark.parametrize("name, pool, env_keys", [
    ("ray-process-pool.yaml", "tfdag-ray", {"RAY_ADDRESS", "MLFLOW_TRACKING_URI"}),
    ("ray-k8s-work-pool.yaml", "tfdag-k8s", {"RAY_ADDRESS", "MLFLOW_TRACKING_URI"}),
])
def test_ray_templates_uncommented_are_valid_prefect_yaml(name, pool, env_keys):
    lines = (ROOT / "deployments" / name).read_text().splitlines()
    body = lines[lines.index("# name: tfdag"):]
    assert all(line.startswith("#") for line in body), "the template stays commented out"
    model = _load_text("\n".join(line[2:] if line.startswith("# ") else line[1:] for line in body))
    (deployment,) = model.deployments
    assert deployment.entrypoint == "flows/pipeline.py:training_pipeline" and deployment.work_pool.name == pool
    assert set(deployment.work_pool.job_variables["env"]) == env_keys
