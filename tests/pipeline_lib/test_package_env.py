"""What importing `pipeline_lib` sets for every tfdag process: MLflow's usage telemetry off, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

READ = ("import pipeline_lib; from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY; "
        "print(MLFLOW_DISABLE_TELEMETRY.get())")


@pytest.mark.parametrize("given,disabled", [(None, "True"), ("false", "False")])
def test_mlflow_telemetry_is_off_in_a_tfdag_process_unless_the_environment_turns_it_on(given, disabled):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    if given is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = given
    done = subprocess.run([sys.executable, "-c", READ], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.strip() == disabled
