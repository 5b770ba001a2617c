"""Resuming the demo killed during evaluation (`tfdag run examples/digits.yaml --resume`) against the fixed cost of
a fresh run: the same demo's wall time less its training, both against a running Prefect server.

- value: the resume's wall time. A fresh `tfdag run --resume` process finds the killed run, skips what finished
  (conversion, the plan, training, the export), reopens its MLflow run and runs the stages left: evaluation, the
  model's log and check, the gate and registration;
- baseline: a fresh `tfdag run` of the demo less its `train` stage (its stage record's seconds): everything a run
  does but training.
Each round runs the baseline, then a run SIGKILLed (its process group) once `evaluate` starts, then its resume.
A resume that trains again fails the suite. Target: ratio ≥ 1, a resume costs at most a run without training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import case
from bench.bench_orchestration import DEMO_CONFIG

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tfdag(project: str, api_url: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PREFECT_API_URL=api_url, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", DEMO_CONFIG, *args, "--json"], cwd=project,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=900)
    if process.returncode not in (0, 3):  # 3: trained, not blessed
        raise RuntimeError(f"tfdag run exited {process.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _stages(project: str, run_name: str) -> list[dict]:
    return json.loads(Path(project, ".tfdag", "runs", run_name, "stages.json").read_text())["stages"]


def _kill_at_evaluate(project: str, process: subprocess.Popen, known: set[str]) -> str:
    """SIGKILL the run's process group once its stage record shows `evaluate` running; returns the run's name."""
    runs = Path(project, ".tfdag", "runs")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the run ended before evaluate: {process.stderr.read()[-3000:]}")
        for run_dir in (p for p in runs.glob("*") if p.name not in known):
            try:
                stages = _stages(project, run_dir.name)
            except (OSError, ValueError):
                continue
            if stages and stages[-1]["name"] == "evaluate":
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)
                return run_dir.name
        time.sleep(0.02)
    raise RuntimeError("evaluate did not start within 600 s")


def run(rows: int = 0, width: int = 0, quick: bool = False, repeats: int = 3) -> list[dict]:
    from flows import stack
    from pipeline_lib.core import net

    repeats = 1 if quick else repeats
    fresh_s: list[float] = []
    without_training_s: list[float] = []
    resume_s: list[float] = []
    with tempfile.TemporaryDirectory() as project:
        server = stack.start_prefect_server(Path(project) / "prefect-server", net.free_port())
        api_url = server.url + "/api"
        try:
            _finish(_tfdag(project, api_url))  # warm-up: the digits CSV, its conversion, the MLflow database
            for index in range(repeats):
                start = time.perf_counter()
                summary = _finish(_tfdag(project, api_url))
                fresh_s.append(time.perf_counter() - start)
                train_s = sum(s["seconds"] or 0.0 for s in _stages(project, summary["run_name"]) if s["name"] == "train")
                without_training_s.append(fresh_s[-1] - train_s)

                known = {p.name for p in Path(project, ".tfdag", "runs").glob("*")}
                killed = _kill_at_evaluate(project, _tfdag(project, api_url), known)
                start = time.perf_counter()
                resumed = _finish(_tfdag(project, api_url, "--resume"))
                resume_s.append(time.perf_counter() - start)
                names = [s["name"] for s in _stages(project, killed)]
                after_kill = names[names.index("reopen_tracking_run"):] if "reopen_tracking_run" in names else names
                if resumed["run_name"] != killed or names.count("train") != 1:
                    raise RuntimeError(f"the resume of {killed} trained again or resumed another run: {names}")
                print(f"  round {index + 1}: fresh run {fresh_s[-1]:.1f}s (train {train_s:.1f}s) | resume of a run "
                      f"killed in evaluate {resume_s[-1]:.1f}s, stages {after_kill}", flush=True)
        finally:
            stack.stop_process(server)
    return [case("tfdag run --resume of the demo killed in evaluate vs a fresh run without its training (s)",
                 resume_s, without_training_s, 1.0, higher_is_better=False, unit="s",
                 baseline_name="a fresh tfdag run of the demo, less its train stage",
                 bound="a fresh process's imports, reopening the MLflow run, then the stages left (evaluation, the "
                       "model's log and fresh-process check, registration); conversion, the plan, training and the "
                       "export are read back from the stage record.")]
