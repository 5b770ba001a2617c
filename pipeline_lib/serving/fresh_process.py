"""The model check's fresh process, kept apart from `serving.validation` so that it loads without TensorFlow:
`tfdag run` starts it before its own imports (`warm_up`), and the check takes it (`take_process`).

A fresh process imports TensorFlow and MLflow as soon as it starts, then waits for the one request it serves (see
`fresh_load.wait_for_request`); a process that no check takes ends with its caller.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping

from pipeline_lib.serving import fresh_load

logger = logging.getLogger(__name__)


def _fresh_environment() -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    environment.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    return environment


# What importing the fresh process's modules (TensorFlow, MLflow, pandas) sets in the importing process's
# environment: a caller that imported them since the process started differs from it there, and the process's own
# imports set the same (tests/pipeline_lib/serving/test_validation.py checks the list against the installed versions).
SET_BY_IMPORTS = frozenset({"ENABLE_RUNTIME_UPTIME_TELEMETRY", "HDF5_PLUGIN_PATH", "KMP_DUPLICATE_LIB_OK",
                            "KMP_INIT_AT_FORK", "TF2_BEHAVIOR", "TPU_ML_PLATFORM", "TPU_ML_PLATFORM_VERSION"})


def _changed_at_import(before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The variables that differ between two environments, but for MLflow's own (`MLFLOW_*`, `_MLFLOW_*`) and those
    that the fresh process's imports set (`SET_BY_IMPORTS`, when they were not set before)."""
    return sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name)
                  and not name.lstrip("_").startswith("MLFLOW_")
                  and not (name in SET_BY_IMPORTS and name not in before))


class FreshProcess:
    """`fresh_load.py` in a new interpreter (`python -I`, an empty working directory): it imports TensorFlow
    and MLflow at once, then runs the one request `send` sends it. Its output goes to a temporary file, so a
    process that waits long never blocks on a full pipe; it ends at end of input, so it dies with its caller."""

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.started = time.monotonic()
        self.environment = _fresh_environment()
        self.cwd = tempfile.mkdtemp(prefix="tfdag-model-check-cwd-")
        self.output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by close()
        self.popen = subprocess.Popen([sys.executable, "-I", fresh_load.__file__], cwd=self.cwd,
                                      env=self.environment, stdin=subprocess.PIPE, stdout=self.output,
                                      stderr=subprocess.STDOUT, text=True)
        self.store_opened = False
        self.open_store(tracking_uri)

    def open_store(self, tracking_uri: str | None) -> None:
        """Have the process open `tracking_uri`'s store while it waits (a database's connection and schema check),
        once. Only a store that exists: a run makes a new database's schema, and two processes making it at once
        collide ("table ... already exists")."""
        if not tracking_uri or self.store_opened:
            return
        self.store_opened = True
        with contextlib.suppress(OSError):  # a process that died at once: `finish` reports it, with its output
            self.popen.stdin.write(json.dumps({"tracking_uri": tracking_uri}) + "\n")
            self.popen.stdin.flush()

    def unusable(self) -> str | None:
        """Why this process cannot serve a check now, or None: it must still wait, started in the environment a
        process started now would get, but for MLflow's own variables (a run sets its HTTP retries once the process
        waits; MLflow reads them when used): `send` sends the environment of now with the request."""
        if self.popen.poll() is not None:
            return "it ended"
        changed = _changed_at_import(self.environment, _fresh_environment())
        return f"the environment changed since it started, at {', '.join(changed)}" if changed else None

    def send(self, request_path: str, tracking_uri: str | None) -> None:
        """Send the request: the process runs it at once (`finish` waits for it)."""
        message = {"request": request_path, "tracking_uri": tracking_uri, "environment": _fresh_environment()}
        with contextlib.suppress(OSError):  # a process that died: `finish` reports it, with its output
            self.popen.stdin.write(json.dumps(message) + "\n")
            self.popen.stdin.flush()

    def finish(self, timeout_s: float) -> str:
        """Wait for the process to end, its request sent; its output (for an error's tail)."""
        try:
            self.popen.communicate(timeout=timeout_s)
            self.output.seek(0)
            return f"exit {self.popen.returncode}: {self.output.read().strip()[-1500:]}"
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the fresh process ran past {timeout_s:g} s") from None
        finally:
            self.close()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.output.close()
        shutil.rmtree(self.cwd, ignore_errors=True)


_warm: FreshProcess | None = None
_warm_lock = threading.Lock()


def warm_up(tracking_uri: str | None = None) -> int:
    """Start the model check's fresh process now, so that its TensorFlow and MLflow imports (and the opening of
    `tracking_uri`'s store, where the logged model will be) overlap the run's training; the next check takes it.
    Returns at once (nothing is started if one waits already: that one opens `tracking_uri`'s store, if it had not):
    its pid."""
    global _warm
    with _warm_lock:
        why = _warm.unusable() if _warm is not None else "none waits"
        if why:
            if _warm is not None:
                logger.debug("model check: the waiting process %d is replaced: %s", _warm.popen.pid, why)
                _warm.close()
            _warm = FreshProcess(tracking_uri)
        else:
            _warm.open_store(tracking_uri)
        return _warm.popen.pid


def discard_warm() -> None:
    """End a fresh process started by `warm_up` that no check took (the run failed or stopped before its check)."""
    global _warm
    with _warm_lock:
        if _warm is not None:
            _warm.close()
            _warm = None


@contextlib.contextmanager
def warmed(enabled: bool, tracking_uri: str | None = None) -> Iterator[None]:
    """`warm_up(tracking_uri)` on entry when `enabled`; on exit, `discard_warm` (what no check took ends with the
    block)."""
    if enabled:
        warm_up(tracking_uri)
    try:
        yield
    finally:
        discard_warm()


def take_process() -> FreshProcess:
    """The warm process when it can serve this check, else a new one."""
    global _warm
    with _warm_lock:
        taken, _warm = _warm, None
    why = taken.unusable() if taken is not None else None
    if taken is not None and why is None:
        logger.debug("model check: in fresh process %d, started %.1f s ago", taken.popen.pid,
                     time.monotonic() - taken.started)
        return taken
    if taken is not None:
        logger.debug("model check: the warm process is not used: %s", why)
        taken.close()
    process = FreshProcess()
    logger.debug("model check: in fresh process %d, started now", process.popen.pid)
    return process
