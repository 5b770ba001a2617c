"""Session fixtures of the serving tests: two small registered models of the wine table (a string column, missing
cells; a string label, and a regression label), the clean virtualenv holding only their recorded requirements
(tests/serving/clean_venv.py), and one `mlflow models serve` of the classifier's champion run from that venv.

tests/conftest.py puts every test of this folder in one xdist group, so each is made once per session.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline_lib.core.net import LOOPBACK, free_port
from tests.serving.clean_venv import (
    VenvBuildError,
    clean_env,
    ensure_clean_venv,
    requirement_lines,
)

CLASSIFIER = "tfdag-serving-wine"
REGRESSOR = "tfdag-serving-alcohol"
CHAMPION = "champion"
IN_VENV_SCRIPT = Path(__file__).with_name("in_clean_venv.py")


@dataclass(frozen=True)
class Registered:
    name: str
    version: int
    manifest: Any  # the converted table's Manifest
    export: Any  # consolidation's ExportResult: saved_model_dir, keras_path


@dataclass(frozen=True)
class ServedModels:
    root: Path
    tracking_uri: str
    classifier: Registered
    regressor: Registered


def _train_and_register(root: Path, source: str, tracking_uri: str, name: str, label: str, task: str,
                        steps: int) -> Registered:
    from pipeline_lib.config import parse_config
    from pipeline_lib.data.convert import convert
    from pipeline_lib.evaluation import consolidation
    from pipeline_lib.planning import sharding
    from pipeline_lib.tracking import model_logging
    from pipeline_lib.tracking import run as tracking
    from pipeline_lib.training import loop as training

    # A handful of steps: these tests prove the plumbing, not the accuracy (test_preprocessing.py proves that).
    config = parse_config({"name": name, "data": {"source": source, "label": label, "on_bad_record": "skip"},
                           "output_root": str(root / name), "model": {"task": task},
                           "train": {"steps": steps, "isolation": "none"},
                           "tracking": {"mlflow_uri": tracking_uri, "experiment": "serving", "registered_model": name},
                           "preflight": {"enabled": False}})
    manifest = convert(config.data, config.output_root)
    plan = sharding.plan_for_train(manifest, config.train, 1)
    result = training.train(config, manifest, plan, str(root / name / "run"))
    export = consolidation.consolidate(config, manifest, result, str(root / name / "run" / "export"))
    run_id = tracking.start_run(config, name)
    version = model_logging.log_and_register_model(run_id, tracking_uri, export.saved_model_dir, export.keras_path,
                                                   name, manifest)
    tracking.finish_run(run_id, tracking_uri)
    return Registered(name=name, version=version.version, manifest=manifest, export=export)


@pytest.fixture(scope="session")
def served_models(tmp_path_factory) -> ServedModels:
    """The wine table (13 numbers, the `cellar` strings, 5 % of the cells empty) trained a few steps twice, logged
    and registered in a sqlite store: `cultivar` (classification, string label; alias champion) and `alcohol`
    (regression, its rows with an empty label skipped). 16-30 s measured: two conversions, 14 steps, two
    exports and two model loggings (MLflow loads each model to check its input example)."""
    from mlflow import MlflowClient

    from tests.pipeline_lib.data.wine_support import write_wine_csv

    root = tmp_path_factory.mktemp("serving")
    source = write_wine_csv(root / "wine.csv", missing_rate=0.05)
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    classifier = _train_and_register(root, source, tracking_uri, CLASSIFIER, "cultivar", "classification", 10)
    regressor = _train_and_register(root, source, tracking_uri, REGRESSOR, "alcohol", "regression", 4)
    MlflowClient(tracking_uri).set_registered_model_alias(CLASSIFIER, CHAMPION, str(classifier.version))
    return ServedModels(root=root, tracking_uri=tracking_uri, classifier=classifier, regressor=regressor)


def recorded_requirements(served: ServedModels, registered: Registered) -> list[str]:
    """The requirements MLflow recorded with the registered model (its requirements.txt)."""
    import mlflow

    from pipeline_lib.tracking.client import global_tracking_uri

    with global_tracking_uri(served.tracking_uri):
        path = mlflow.pyfunc.get_model_dependencies(f"models:/{registered.name}/{registered.version}")
    return requirement_lines(Path(path).read_text())


@pytest.fixture(scope="session")
def clean_venv(served_models) -> Path:
    """A venv of only the classifier's recorded requirements (the regressor records the same), tfdag absent.

    Kept between sessions (tests/serving/clean_venv.py); `./.ci/install-test-deps` builds it before `make test`.
    A first build downloads TensorFlow and MLflow: minutes. Under CI=true a failed build fails; elsewhere the
    tests skip only when pip could not reach the package index.
    """
    requirements = recorded_requirements(served_models, served_models.classifier)
    assert requirements == recorded_requirements(served_models, served_models.regressor)
    try:
        return ensure_clean_venv(requirements)
    except VenvBuildError as error:
        if error.unreachable and os.environ.get("CI") != "true":
            pytest.skip(f"the clean virtualenv could not be built, the package index is unreachable: {error}")
        raise


def run_in_venv(venv: Path, work: Path, request: dict, **env: str) -> dict:
    """Run tests/serving/in_clean_venv.py with the venv's python (a process that never imports tfdag) on
    `request` ({command: payload}); request and answer travel as pickles (same pandas and numpy on both sides)."""
    request_path, response_path = work / "request.pkl", work / "response.pkl"
    request_path.write_bytes(pickle.dumps(request))
    done = subprocess.run([str(venv / "bin" / "python"), str(IN_VENV_SCRIPT), str(request_path), str(response_path)],
                          check=False, cwd=work, env=clean_env(venv, **env), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"in_clean_venv.py failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return pickle.loads(response_path.read_bytes())


@dataclass(frozen=True)
class ScoringServer:
    url: str
    model_uri: str
    log_path: Path


def _wait_for_ping(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"`mlflow models serve` exited with rc {process.returncode} before answering "
                                 f"/ping:\n{log_path.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"`mlflow models serve` did not answer {url}/ping within {timeout_s:.0f} s:\n"
                         f"{log_path.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="package")  # stopped after the last test of tests/serving (one xdist group), not idle after it
def scoring_server(served_models, clean_venv, tmp_path_factory):
    """`mlflow models serve -m models:/<classifier>@champion --env-manager local` on loopback, run by the clean venv's
    mlflow against the sqlite store; stopped after tests/serving's last test. Importing TensorFlow and MLflow and loading
    the model in a new process: 17-30 s measured, over a minute on two busy cores; one server for the session."""
    work = tmp_path_factory.mktemp("scoring_server")
    port = free_port()
    model_uri = f"models:/{CLASSIFIER}@{CHAMPION}"
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(clean_venv / "bin" / "mlflow"), "models", "serve", "-m", model_uri,
                                    "--env-manager", "local", "-h", LOOPBACK, "-p", str(port)],
                                   cwd=work, env=clean_env(clean_venv, MLFLOW_TRACKING_URI=served_models.tracking_uri),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    try:
        _wait_for_ping(process, url, log_path, timeout_s=240)
        yield ScoringServer(url=url, model_uri=model_uri, log_path=log_path)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the CLI and the uvicorn it started: this session's group
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
