"""The console of `tfdag run` is for people: no TensorFlow start-up lines, no warnings answered elsewhere, a short
log; `-v` brings TensorFlow's lines back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("oneDNN", "cuda_platform", "cudart_stub", "Value in checkpoint could not be found", "Sharding callback",
         "is deprecated", "UserWarning", "absl::InitializeLog")


def _tfdag(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFDAG_VERBOSE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900, check=False)


@pytest.mark.slow
def test_a_default_run_of_the_example_prints_fewer_than_60_lines_and_no_noise(tmp_path, prefect_api):
    shutil.copy(ROOT / "examples" / "digits.yaml", tmp_path / "digits.yaml")
    out = _tfdag(tmp_path, "run", "digits.yaml")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    found = {marker: [line for line in lines if marker in line][:2] for marker in NOISE}
    assert not any(found.values()), {k: v for k, v in found.items() if v}
    assert len(lines) < 60, "\n".join(lines)
    assert "blessed: true" in out.stdout


def test_verbose_brings_tensorflow_start_up_lines_back(tmp_path):
    shutil.copy(ROOT / "examples" / "digits.yaml", tmp_path / "digits.yaml")
    quiet = _tfdag(tmp_path, "convert", "digits.yaml")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "oneDNN" not in quiet.stderr and "absl::InitializeLog" not in quiet.stderr
    verbose = _tfdag(tmp_path, "-v", "convert", "digits.yaml")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "oneDNN" in verbose.stderr or "cudart_stub" in verbose.stderr, verbose.stderr[:3000]
