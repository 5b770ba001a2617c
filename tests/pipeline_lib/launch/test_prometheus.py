"""A real Prometheus server (Debian's `prometheus`) scrapes a 2-worker run through the run's file_sd targets file:
`tfdag_steps_total` for both workers, increasing, with the right labels, and each worker's input wait and gradient
norm; after the run the targets are gone. And a task's endpoint renders what an execution measured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pipeline_lib.core.net import free_port
from pipeline_lib.launch.local import launch
from pipeline_lib.launch.prometheus import TARGETS_NAME, TaskMetrics
from pipeline_lib.training.hooks import Execution
from tests.pipeline_lib.launch_support import (
    LogCapture,
    make_config,
    make_spec,
    plan_for,
    write_dataset_on_disk,
)


def require_prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        missing = "prometheus is not installed (`make test` installs Debian's `prometheus` when run as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: under CI=true a missing part fails the run")
        pytest.skip(missing)
    return found


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server on 127.0.0.1 scraping every second whatever the run's targets file lists."""
    binary = require_prometheus()
    run_dir = tmp_path / "run"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tfdag\n    file_sd_configs:\n"
        f"      - files: ['{run_dir / TARGETS_NAME}']\n        refresh_interval: 1s\n")
    port = free_port("127.0.0.1")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "prometheus did not start"
                time.sleep(0.5)
        yield url, run_dir
    finally:
        process.terminate()
        process.wait(timeout=30)


def _steps_by_worker(url: str) -> dict[str, float]:
    query = urllib.parse.quote("tfdag_steps_total")
    result = _get(f"{url}/api/v1/query?query={query}")["data"]["result"]
    return {r["metric"]["task_index"]: float(r["value"][1]) for r in result
            if r["metric"].get("task_type") == "worker"}


@pytest.mark.slow
def test_a_real_prometheus_scrapes_both_workers_and_the_targets_go_away_after_the_run(prometheus, tmp_path):
    url, run_dir = prometheus
    dataset = write_dataset_on_disk(str(tmp_path / "data"), num_train=512, num_eval=64)
    config = make_config(str(tmp_path), workers=2, per_replica_batch_size=16, checkpoint_every_steps=1000,
                         log_every_steps=500)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=800), str(run_dir))
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=launch(spec, config, log_fn=LogCapture())))
    thread.start()
    seen: list[dict[str, float]] = []
    try:
        while thread.is_alive():
            steps = _steps_by_worker(url)
            if set(steps) == {"0", "1"}:
                seen.append(steps)
                if len(seen) >= 2 and all(seen[-1][w] > seen[0][w] for w in ("0", "1")):
                    break
            time.sleep(0.5)
        # Labels of one series, while the run is still being scraped.
        labels = _get(f"{url}/api/v1/query?query=tfdag_loss")["data"]["result"]
        lag = _get(f"{url}/api/v1/query?query=tfdag_worker_step_lag")["data"]["result"]
        waits = _get(f"{url}/api/v1/query?query=tfdag_input_wait_seconds_count")["data"]["result"]
        norms = _get(f"{url}/api/v1/query?query=tfdag_gradient_norm")["data"]["result"]
    finally:
        thread.join()
    assert len(seen) >= 2, f"Prometheus never saw both workers' steps increase: {seen}"
    assert all(seen[-1][w] > seen[0][w] for w in ("0", "1")), seen
    assert outcome["result"].result.final_step == 800
    assert {(r["metric"]["run"], r["metric"]["task_type"], r["metric"]["task_index"]) for r in labels} <= {
        ("run", "worker", "0"), ("run", "worker", "1")}
    assert labels, "no tfdag_loss series"
    assert {r["metric"]["task_index"] for r in lag} <= {"0", "1"}
    # Both workers had stepped when these were queried: every step observed its input wait.
    assert {(r["metric"]["run"], r["metric"]["task_type"], r["metric"]["task_index"]): float(r["value"][1]) > 0
            for r in waits} == {("run", "worker", "0"): True, ("run", "worker", "1"): True}, waits
    assert {r["metric"]["task_index"] for r in norms} == {"0", "1"}
    assert all(0 < float(r["value"][1]) < float("inf") for r in norms), norms

    # After the run: the targets file lists nothing, and Prometheus drops the targets.
    assert json.loads(Path(run_dir / TARGETS_NAME).read_text()) == []
    deadline = time.monotonic() + 30
    while _get(f"{url}/api/v1/targets")["data"]["activeTargets"]:
        assert time.monotonic() < deadline, "Prometheus still lists the run's targets"
        time.sleep(0.5)


def test_a_task_endpoint_serves_each_steps_input_wait_with_the_task_labels():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = TaskMetrics("run-7", "worker", 1, "127.0.0.1")
    try:
        metrics.on_execution(Execution(step=3, steps=3, examples=96, seconds=0.3, loss=0.5, learning_rate=0.01,
                                       gradient_norms=(1.0, 2.0, 3.0), input_waits_s=(0.002, 0.2, 0.004)))
        with urllib.request.urlopen(f"http://{metrics.target}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        metrics.close()
    samples = {(s.name, s.labels.get("le")): (s.labels, s.value)
               for family in text_string_to_metric_families(text) for s in family.samples}
    labels, count = samples[("tfdag_input_wait_seconds_count", None)]
    assert labels == {"run": "run-7", "task_type": "worker", "task_index": "1"} and count == 3
    assert samples[("tfdag_input_wait_seconds_sum", None)][1] == pytest.approx(0.206)
    assert samples[("tfdag_input_wait_seconds_bucket", "0.005")][1] == 2  # two of the three waits were short
    assert samples[("tfdag_gradient_norm", None)][1] == 2.0  # the execution's mean
    assert samples[("tfdag_steps_total", None)][1] == 3
