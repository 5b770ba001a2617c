"""The model check before registration on a trained wine model (a string column, a string label, missing cells,
columns named as a table may name them: Python keywords, spaces, punctuation, non-ASCII, a leading digit, two
names that sanitize alike): the export passes through both public loaders in a fresh process and answers under
the table's own column names; a broken one fails naming the loader and the fix.

Each `validate_model` call runs in one fresh interpreter that imports TensorFlow and MLflow (~10 s on 2 busy cores),
started ahead by `warm_up` as a run does, or at the call: two calls in this file, one per verdict."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import mlflow
import numpy as np
import psutil
import pytest

from pipeline_lib.config import Task, parse_config
from pipeline_lib.serving import fresh_process, validation
from pipeline_lib.serving.tfdag_scoring import read_serving_spec
from pipeline_lib.serving.validation import PYFUNC_LOADER, SAVED_MODEL_LOADER
from pipeline_lib.testing.export_faults import break_export
from pipeline_lib.tracking.client import global_tracking_uri
from tests.pipeline_lib.data.wine_support import write_wine_csv
from tests.pipeline_lib.serving.model_support import train_export_and_log

# Wine's columns renamed to what a table may hold: keywords (numeric, string and the label), TensorFlow's `self`,
# a space and punctuation, a leading digit, non-ASCII, and `x y` / `x_y`, one signature input name once sanitized.
ODD_NAMES = {"alcohol": "class", "malic_acid": "None", "ash": "from", "alcalinity_of_ash": "self",
             "magnesium": "magnesium (mg/l)", "total_phenols": "1st phenols", "flavanoids": "flavanoïdes",
             "nonflavanoid_phenols": "x y", "proanthocyanins": "x_y", "cellar": "numeric", "cultivar": "lambda"}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The wine table, with `ODD_NAMES`, trained 20 steps, exported, logged to a sqlite store; 64 eval rows."""
    root = tmp_path_factory.mktemp("wine_check")
    source = write_wine_csv(root / "wine.csv", missing_rate=0.1, rename=ODD_NAMES)
    config = parse_config({"name": "wine", "data": {"source": source, "label": ODD_NAMES["cultivar"]},
                           "output_root": str(root / "out"), "tracking": {"experiment": "wine-check"},
                           "preflight": {"enabled": False}})
    made = train_export_and_log(config, root)
    return config, made.manifest, made.export, made.logged, made.sample


def test_the_export_loads_without_tfdag_in_a_fresh_process_and_predicts_like_the_trained_model(checked, caplog):
    config, manifest, export, logged, sample = checked
    warm = fresh_process.warm_up()  # as a run does while it trains

    with caplog.at_level(logging.DEBUG, logger=fresh_process.__name__):
        result = validation.validate_model(export.saved_model_dir, export.keras_path, logged.model_uri,
                                           config.mlflow_uri, sample, manifest.feature_schema, Task.CLASSIFICATION)

    assert result.passed, result.reason
    assert f"model check: in fresh process {warm}, started" in caplog.text  # the warm process, taken
    assert fresh_process.warm_up() != warm  # and used up: the next check gets a process of its own
    fresh_process.discard_warm()
    assert [c.loader for c in result.checks] == [SAVED_MODEL_LOADER, PYFUNC_LOADER] and result.skipped == ()
    assert all(c.passed and c.max_abs_diff <= 1e-5 and c.labels_differ == 0 for c in result.checks)
    assert result.rows == len(sample) == manifest.num_records("eval") and result.rows_with_missing > 0  # with missing cells
    assert f"reproduce the trained model on {len(sample)} eval rows" in result.reason
    assert "| `mlflow.pyfunc.load_model` |" in result.to_markdown()
    # Served under the table's own names: the sample's columns are those, and so are tfdag_serving.json's.
    odd_features = set(ODD_NAMES.values()) - {"lambda"}
    assert odd_features <= set(sample.columns)
    assert [c["name"] for c in read_serving_spec(export.saved_model_dir)["columns"]] == list(
        manifest.feature_schema.feature_names) and odd_features <= set(manifest.feature_schema.feature_names)


def test_a_broken_export_and_a_logged_model_without_its_code_fail_naming_each_loader_and_the_fix(checked, tmp_path,
                                                                                                  monkeypatch, caplog):
    config, manifest, export, logged, sample = checked
    saved = str(tmp_path / "saved_model")
    shutil.copytree(export.saved_model_dir, saved)
    break_export(saved, "corrupt_variables")
    # The logged model without the scoring module it ships: its loader falls back to tfdag, which is not there.
    with global_tracking_uri(config.mlflow_uri):
        pyfunc = mlflow.artifacts.download_artifacts(logged.model_uri, dst_path=str(tmp_path / "pyfunc"))
    os.remove(os.path.join(pyfunc, "code", "tfdag_scoring.py"))

    warm = fresh_process.warm_up()
    monkeypatch.setenv("TFDAG_MODEL_CHECK_PROBE", "1")  # after the warm-up: a process started now would see it

    with caplog.at_level(logging.DEBUG, logger=fresh_process.__name__):
        result = validation.validate_model(saved, export.keras_path, pyfunc, None, sample.head(8),
                                           manifest.feature_schema, Task.CLASSIFICATION)

    assert "model check: in fresh process" in caplog.text and f"fresh process {warm}," not in caplog.text
    assert not psutil.pid_exists(warm) or psutil.Process(warm).status() == psutil.STATUS_ZOMBIE

    assert not result.passed
    saved_check, pyfunc_check = result.checks
    assert not saved_check.passed and saved_check.uri == saved and "re-export" in saved_check.fix
    assert not pyfunc_check.passed and "pipeline_lib" in pyfunc_check.error and "code_paths" in pyfunc_check.fix
    assert result.reason.startswith("the model check failed: tf.saved_model.load(")
    assert "mlflow.pyfunc.load_model(" in result.reason and "fix: " in result.reason


def test_a_fresh_process_past_its_timeout_fails_the_check_and_a_model_not_logged_skips_the_mlflow_loader(checked):
    _config, manifest, export, _logged, sample = checked

    result = validation.validate_model(export.saved_model_dir, export.keras_path, None, None, sample.head(4),
                                       manifest.feature_schema, Task.CLASSIFICATION, timeout_s=0.01,
                                       pyfunc_skipped_because="tracking is disabled")

    assert not result.passed and [c.loader for c in result.checks] == [SAVED_MODEL_LOADER]
    assert result.skipped == ("mlflow.pyfunc.load_model: tracking is disabled",)
    assert "the fresh process ran past 0.01 s; fix: the SavedModel must load with TensorFlow alone" in result.reason
    assert "| `mlflow.pyfunc.load_model` | — | skipped: tracking is disabled |" in result.to_markdown()


def test_a_difference_beyond_the_tolerance_or_a_decided_label_fails_and_a_tie_does_not():
    reference = {"probabilities": np.array([[0.7, 0.3], [0.5, 0.5]]), "prediction": np.array(["a", "a"], object)}
    same = {"probabilities": [[0.7, 0.3], [0.5, 0.5]], "prediction": ["a", "b"]}  # row 2: a tie, either label
    assert validation.compare(reference, same, 1e-5) == (0.0, 0)
    off = {"probabilities": [[0.7001, 0.2999], [0.5, 0.5]], "prediction": ["b", "a"]}
    max_diff, labels = validation.compare(reference, off, 1e-5)
    assert max_diff == pytest.approx(1e-4) and labels == 1
    check = validation._loader_check(SAVED_MODEL_LOADER, "dir", {"ok": True, **off}, reference, 1e-5)
    assert not check.passed and "differ from the trained model's by up to 0.0001" in check.error
    assert "label differs on 1 row(s)" in check.error and "raw_to_model_inputs" in check.fix
    regression = {"prediction": np.array([1.0, np.nan])}
    assert validation.compare(regression, {"prediction": [1.0, float("nan")]}, 1e-5) == (0.0, 0)
    assert validation.compare(regression, {"prediction": [1.0, 2.0]}, 1e-5)[0] == float("inf")


# What `tfdag run` does: the fresh process starts, then the caller imports TensorFlow, MLflow and pandas.
_START_THEN_IMPORT = """
import json, os
from pipeline_lib.serving import fresh_process
started = dict(os.environ)
pid = fresh_process.warm_up()
import mlflow.pyfunc, pandas, tensorflow
set_by_imports = sorted(k for k in os.environ if started.get(k) != os.environ[k])
print(json.dumps({"pid": pid, "set_by_imports": set_by_imports, "unusable": fresh_process._warm.unusable()}))
"""


def test_a_warm_fresh_process_outlasts_its_callers_imports_and_ends_with_its_caller():
    done = subprocess.run([sys.executable, "-c", _START_THEN_IMPORT], capture_output=True, text=True, timeout=300,
                          check=True)
    found = json.loads(done.stdout.splitlines()[-1])
    # The caller's imports set what the process's own imports set too: the process still serves its check.
    assert found["unusable"] is None, found
    assert {k for k in found["set_by_imports"] if not k.lstrip("_").startswith("MLFLOW_")} <= (
        fresh_process.SET_BY_IMPORTS), "SET_BY_IMPORTS misses what these versions' imports set"
    # A variable the caller sets (or changes) after the start is a reason not to use it.
    assert fresh_process._changed_at_import({"A": "1"}, {"A": "2", "TF2_BEHAVIOR": "1", "MLFLOW_X": "1"}) == ["A"]
    assert fresh_process._changed_at_import({"TF2_BEHAVIOR": "0"}, {"TF2_BEHAVIOR": "1"}) == ["TF2_BEHAVIOR"]
    warm = found["pid"]
    deadline = time.monotonic() + 120  # it reads its end of input once its imports are done
    while psutil.pid_exists(warm) and psutil.Process(warm).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the fresh process {warm} outlived its caller"
        time.sleep(0.5)
