"""A virtualenv holding only a logged model's recorded requirements (tfdag not installed), built once and kept.

Usable without pytest: `python -m tests.serving.clean_venv` builds the one for the requirements tfdag records now
(`model_logging.requirements()`); `./.ci/install-test-deps` runs it, so `make test` does not pay for it inside the
suite. pip writes no cache on these machines (measured: ~8 minutes for TensorFlow and MLflow under load, 3 GB),
so the venv itself is kept under `.tfdag-test-tools/serving-venv/<hash of the requirements and the interpreter>`
and reused while the requirements stay the same; building another one removes the others.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / ".tfdag-test-tools" / "serving-venv"
_COMPLETE = ".tfdag-complete"  # written last: a folder without it is a build that did not finish
# pip's words when the package index cannot be reached (outside CI the tests then skip, naming this).
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                "Network is unreachable", "ConnectTimeoutError")


class VenvBuildError(RuntimeError):
    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def requirement_lines(text: str) -> list[str]:
    """The requirements of a requirements.txt, without blank lines and comments."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def venv_dir(requirements: Sequence[str]) -> Path:
    key = "\n".join([sys.version, os.path.realpath(sys._base_executable), *requirements])
    return ROOT / hashlib.sha256(key.encode()).hexdigest()[:16]


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """An environment for the venv's programs: its bin first on PATH (`mlflow models serve` execs `uvicorn` from
    PATH), no PYTHONPATH (it would put tfdag back) and no MLflow or TensorFlow settings of the caller's."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("MLFLOW_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def ensure_clean_venv(requirements: Sequence[str]) -> Path:
    """The venv for these requirements, built now if no finished one is kept; proves tfdag is not importable there.

    Raises:
        VenvBuildError: pip failed (`unreachable` when the package index could not be reached), or tfdag imports.
    """
    venv = venv_dir(requirements)
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:  # concurrent sessions (xdist processes, worktrees) build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / _COMPLETE).exists():
            _build(venv, requirements)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import pipeline_lib"], check=False, cwd=venv,
                           env=clean_env(venv), capture_output=True, text=True)
    if probe.returncode == 0 or "No module named 'pipeline_lib'" not in probe.stderr:
        raise VenvBuildError(f"{venv}: `import pipeline_lib` must fail there with ModuleNotFoundError; it gave rc "
                             f"{probe.returncode}: {probe.stderr[-500:]}", unreachable=False)
    return venv


def _build(venv: Path, requirements: Sequence[str]) -> None:
    for other in ROOT.iterdir():
        if other.is_dir():
            shutil.rmtree(other, ignore_errors=True)  # earlier requirements (3 GB each), or an unfinished build
    # `-m venv` from this (virtual) environment makes a venv of the base interpreter, without system site-packages.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / "requirements.txt").write_text("\n".join(requirements) + "\n")
    log = venv / "pip-install.log"
    with open(log, "w") as handle:
        result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-r",
                                 str(venv / "requirements.txt")], check=False, cwd=venv, env=clean_env(venv),
                                stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode:
        text = log.read_text(errors="replace")
        shutil.rmtree(venv, ignore_errors=True)
        raise VenvBuildError(f"pip install -r requirements.txt ({', '.join(requirements)}) failed with rc "
                             f"{result.returncode}: {text[-1500:]}", unreachable=any(w in text for w in _UNREACHABLE))
    (venv / _COMPLETE).write_text("ok\n")


def main() -> int:
    from pipeline_lib.tracking import model_logging

    requirements = model_logging.requirements()
    try:
        venv = ensure_clean_venv(requirements)
    except VenvBuildError as error:
        print(f"clean_venv: {error}", file=sys.stderr)
        return 1
    print(f"clean_venv: {venv} holds {', '.join(requirements)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
