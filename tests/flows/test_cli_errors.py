"""`tfdag run` (and `tfdag train`) on bad input: one line that names the value and the fix, no traceback, exit
code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_lib.data import demo as demo_data

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **overrides) -> dict:
    raw = tmp_path / "raw" / "digits.csv"
    if not raw.exists():
        demo_data.write_digits_csv(str(raw))
    config = {
        "name": "cli-errors",
        "data": {"source": str(raw), "label": "target", "target_shard_mb": 0.1},
        "output_root": str(tmp_path / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [16]}},
        "train": {"strategy": "default", "per_replica_batch_size": 32, "epochs": 1},
        "tracking": {"experiment": "cli-errors"},
    }
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def _run(tmp_path: Path, config: dict, *extra: str, env: dict[str, str] | None = None, command: str = "run"):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "flows.cli", command, str(path), *extra], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=600, check=False)


def _assert_one_line_user_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    console = out.stdout + out.stderr
    assert out.returncode == 2, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tfdag: "), out.stderr[-2000:]
    for text in expected:
        assert text in last, last
    return last


# `tfdag run`'s main() on several configs in one interpreter (one TensorFlow import, not one per config): each
# config its own call, its own environment, its own stdout and stderr (the logging handler writes to the stderr of
# the call running), its own exit code. The input errors before anything runs are independent of each other.
_RUN_EACH = """
import contextlib, io, json, logging, os, sys

class _CurrentStderr:
    def write(self, text): return sys.stderr.write(text)
    def flush(self): sys.stderr.flush()

logging.basicConfig(stream=_CurrentStderr(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from flows.cli import main

results = []
for path, env in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", path])
    os.environ.clear()
    os.environ.update(saved)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _run_each(cases: list[tuple[Path, dict, dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """`tfdag run` on each (folder, config, environment), in one process (_RUN_EACH): a CompletedProcess per case."""
    arguments = []
    for folder, config, env in cases:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "pipeline.yaml"
        path.write_text(yaml.safe_dump(config))
        arguments.append([str(path), env])
    environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run([sys.executable, "-c", _RUN_EACH, json.dumps(arguments)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [subprocess.CompletedProcess([], code, stdout, stderr)
            for code, stdout, stderr in json.loads(done.stdout.strip().splitlines()[-1])]


def test_an_unimportable_factory_a_bad_tf_config_a_missing_source_and_an_unset_variable_are_one_line_each(tmp_path):
    """Each stops `tfdag run` with one line before anything runs (nothing written under output_root)."""
    factory, tf_config, missing, unset = (tmp_path / name for name in ("factory", "tf_config", "missing", "unset"))
    for folder in (factory, tf_config, missing, unset):
        folder.mkdir()
    bad_tf_config = '{"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker", "index": 0}}'
    outs = _run_each([
        (factory, _config(factory, model={"factory": "nosuchpkg.models:build"}), {}),
        (tf_config, _config(tf_config, train={"strategy": "multi_worker_mirrored"}), {"TF_CONFIG": bad_tf_config}),
        (missing, _config(missing, data={"source": str(tmp_path / "nowhere.csv")}), {}),
        (unset, _config(unset, data={"storage_options": {"key": "${TFDAG_TEST_UNSET_KEY}"}}), {}),
    ])
    _assert_one_line_user_error(outs[0], "model.factory 'nosuchpkg.models:build'", "PYTHONPATH")
    _assert_one_line_user_error(outs[1], "127.0.0.1", "port")
    _assert_one_line_user_error(outs[2], "data.source", "nowhere.csv", "tfdag demo-data")
    _assert_one_line_user_error(outs[3], "TFDAG_TEST_UNSET_KEY", "export TFDAG_TEST_UNSET_KEY")
    for folder in (factory, tf_config):
        assert not (folder / "out").exists(), "nothing may be written before the input is checked"


def test_a_label_with_one_value_stops_tfdag_train_as_one_line_before_training(tmp_path):
    # The digits with every label 7: conversion works (the schema even says 8 classes), training must not start.
    raw = tmp_path / "raw" / "digits.csv"
    demo_data.write_digits_csv(str(raw))
    header, *rows = raw.read_text().splitlines()
    column = header.split(",").index("target")
    raw.write_text("\n".join([header, *(",".join("7" if i == column else cell for i, cell in enumerate(row.split(",")))
                                       for row in rows)]) + "\n")
    out = _run(tmp_path, _config(tmp_path), command="train")
    _assert_one_line_user_error(out, "data.label 'target' has one value in the train split (7 on all",
                                "at least two classes")
    assert not (tmp_path / "out" / "runs").exists(), "no training may start"


def test_verbose_shows_the_traceback_of_a_user_error(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, model={"factory": "nosuchpkg.models:build"})))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "-v", "run", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 2
    assert "Traceback" in out.stderr and "ModelFactoryError" in out.stderr


def test_a_run_where_the_c_extension_did_not_build_warns_once_on_the_console(tmp_path):
    """The conversion's C loops missing (None in sys.modules makes their import fail, as after an install without a
    compiler): `tfdag run` says so once, with the fix, where its console shows it, and stops on the input as usual."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, model={"factory": "nosuchpkg.models:build"})))
    without_extension = ("import sys; sys.modules['pipeline_lib.core._native'] = None; from flows.cli import main; "
                         "sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", without_extension, "run", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    _assert_one_line_user_error(out, "model.factory 'nosuchpkg.models:build'")
    [warning] = [line for line in out.stderr.splitlines() if "_native" in line]
    assert "WARNING pipeline_lib.core.native: the C extension pipeline_lib.core._native did not load" in warning
    assert "C compiler" in warning and "make install" in warning, warning


@pytest.mark.slow
def test_a_bad_record_fails_in_the_flow_as_one_line_without_prefect_tracebacks(tmp_path, prefect_api):
    # Types are inferred from the first chunk (4 rows); line 6, in the second, has a value that is not a number
    # (an empty cell would be imputed: data.missing).
    config = _config(tmp_path, data={"read_chunk_rows": 4})
    raw = Path(config["data"]["source"])
    lines = raw.read_text().splitlines()
    cells = lines[5].split(",")
    cells[3] = "abc"
    lines[5] = ",".join(cells)
    raw.write_text("\n".join(lines) + "\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = _run(tmp_path, config, env={"PREFECT_API_URL": prefect_api, "TMPDIR": str(scratch)})
    last = _assert_one_line_user_error(out, str(raw))
    assert "on_bad_record" in last, last
    # The model check's process, started before the run's imports, ended with the run that failed before its check.
    assert not list(scratch.glob("tfdag-model-check-*")), list(scratch.iterdir())


@pytest.mark.slow
def test_a_plan_that_cannot_work_fails_in_the_flow_as_one_line(tmp_path, prefect_api):
    out = _run(tmp_path, _config(tmp_path, train={"per_replica_batch_size": 100_000}),
               env={"PREFECT_API_URL": prefect_api})
    _assert_one_line_user_error(out, "global batch")


@pytest.mark.slow
def test_a_deleted_experiment_fails_in_the_flow_as_one_line(tmp_path, prefect_api):
    from mlflow import MlflowClient

    from pipeline_lib.config import parse_config

    config = _config(tmp_path)
    uri = parse_config(config).mlflow_uri
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("cli-errors"))
    out = _run(tmp_path, config, env={"PREFECT_API_URL": prefect_api})
    _assert_one_line_user_error(out, "tracking.experiment 'cli-errors' is deleted", "mlflow experiments restore")


@pytest.mark.slow
def test_a_model_factory_that_fails_in_a_worker_process_is_one_line(tmp_path, prefect_api):
    # json.dumps imports fine (the check before the flow passes) but rejects the factory's arguments, which
    # only the worker process finds: its UserError travels back through the launcher as one line.
    out = _run(tmp_path, _config(tmp_path, model={"factory": "json:dumps"}), env={"PREFECT_API_URL": prefect_api})
    _assert_one_line_user_error(out, "worker 0: model.factory 'json:dumps' rejected model.params",
                                "check the parameter names")
