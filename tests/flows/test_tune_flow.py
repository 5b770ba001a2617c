"""`tfdag tune`, the tune-pipeline flow, end to end on the session's stack: a 6-trial digits study two trials at a
time, with pruning; its MLflow runs and Prefect artifacts; a study killed mid-way and resumed; a Hyperband study in a
PostgreSQL database whose best model fails the gate."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline_lib.data import demo as demo_data
from tests.postgres import postgres_bin_dir, postgres_cluster
from tests.servers import ROOT, RunningStack

STEPS = 40  # each trial's budget: evaluations at 20 and 40
# The shared study's trials: 2 startup trials for the median pruner, then 4 it may prune (plumbing, not a search).
TRIALS = 6


def study_config(root: Path, name: str, **tune) -> dict:
    raw = root / "raw" / "digits.csv"
    if not raw.exists():
        demo_data.write_digits_csv(str(raw))
    return {
        "name": name,
        "data": {"source": str(raw), "label": "target", "target_shard_mb": 0.1},
        "output_root": str(root / "out"),
        "model": {"factory": "mlp", "params": {"hidden_units": [32], "dropout": 0.1}},
        "train": {"per_replica_batch_size": 32, "base_learning_rate": 0.002, "steps": STEPS,
                  "checkpoint_every_steps": 20, "log_every_steps": 20, "seed": 7},
        "evaluation": {"metrics": ["loss", "accuracy"], "gate": {"threshold": 0.8}},
        "tracking": {"experiment": name, "registered_model": f"{name}-model"},
        "tune": {"seed": 0, "space": {
            "train.base_learning_rate": {"loguniform": [1.0e-4, 0.3]},
            "model.params.hidden_units": {"choice": [[32], [64, 32]]},
            "model.params.dropout": {"uniform": [0.0, 0.5]},
        }, **tune},
    }


def tune_command(running: RunningStack, config_path: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "tune", str(config_path), "--json"], cwd=ROOT,
                            env=running.cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def load_study(config: dict):
    import optuna

    from pipeline_lib.config import parse_config
    from pipeline_lib.tuning.study import create_storage, storage_url, study_name

    parsed = parse_config(config)
    return optuna.load_study(study_name=study_name(parsed), storage=create_storage(storage_url(parsed)))


@dataclass(frozen=True)
class Study:
    config: dict
    output: str
    summary: dict


@pytest.fixture(scope="session")  # session: torn down once, whatever runs between its tests (its group keeps them in one process)
def tune_study(tmp_path_factory, tfdag_stack) -> Study:
    """`tfdag tune --json` once: TRIALS trials, 2 at a time, the median pruner after 2 complete trials."""
    root = tmp_path_factory.mktemp("tune")
    config = study_config(root, "digits-tune-test", trials=TRIALS, parallel=2, startup_trials=2)
    path = root / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    process = tune_command(tfdag_stack, path)
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-5000:]
    return Study(config, output, json.loads(output.strip().splitlines()[-1]))


@pytest.mark.slow
def test_a_few_trials_two_at_a_time_find_a_model_at_least_as_good_as_the_config_and_register_it(tune_study):
    import optuna

    summary = tune_study.summary
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] == TRIALS and summary["trials"]["failed"] == 0
    trials = {t.number: t for t in load_study(tune_study.config).trials}
    # Trial 0 is the config as written; the best is at least as good on the same budget.
    first = trials[0]
    assert first.params["train.base_learning_rate"] == pytest.approx(0.002)
    assert json.loads(first.params["model.params.hidden_units"]) == [32]
    assert first.state == optuna.trial.TrialState.COMPLETE
    best = summary["best_trial"]
    assert best["value"] >= first.value
    assert best["value"] == max(t.value for t in trials.values() if t.state == optuna.trial.TrialState.COMPLETE)
    # The best trial's model went through evaluation, the gate and registration like a `tfdag run` model.
    model = summary["model"]
    assert model["metrics"]["accuracy"] == pytest.approx(best["value"], abs=1e-6)
    assert summary["blessed"] and model["blessed"] and model["model_version"] == "1"
    # Two trials trained at once: some pair of trials overlapped in time.
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials.values())
    assert any(later_start < end for (_, end), (later_start, _) in itertools.pairwise(spans))


@pytest.mark.slow
def test_a_pruned_trial_stopped_before_its_budget_at_an_evaluation(tune_study):
    import optuna

    pruned = [t for t in load_study(tune_study.config).trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, f"the median pruner pruned no trial of {TRIALS} (a learning rate up to 0.3 and down to 1e-4)"
    for trial in pruned:
        last = max(trial.intermediate_values)
        assert last < STEPS and last % 20 == 0
        result = trial.user_attrs["tfdag.train_result"]
        assert result["pruned"] and result["final_step"] == last


@pytest.mark.slow
def test_mlflow_has_the_study_run_a_nested_run_per_trial_and_the_model_run_links_its_trial(tune_study):
    from mlflow.tracking import MlflowClient

    from pipeline_lib.config import parse_config

    config = parse_config(tune_study.config)
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    parent = client.get_run(tune_study.summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["tune.trials_complete"] + parent.data.metrics["tune.trials_pruned"] == TRIALS
    assert parent.data.tags["tfdag.tune.best_trial"] == str(tune_study.summary["best_trial"]["number"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "tune")}
    assert {"tune/optimization_history.png", "tune/param_importances.png", "tune/space.json"} <= artifacts
    experiment = parent.info.experiment_id
    nested = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=50)
    trial_runs = {r.data.tags["tfdag.tune.trial"]: r for r in nested if "tfdag.tune.state" in r.data.tags}
    assert sorted(map(int, trial_runs)) == list(range(TRIALS))
    for run in trial_runs.values():
        assert run.info.status == "FINISHED"
        assert {"tune.train.base_learning_rate", "tune.model.params.hidden_units"} <= set(run.data.params)
        assert run.data.tags["tfdag.tune.state"] in ("complete", "pruned")
        assert client.get_metric_history(run.info.run_id, "checkpoint/eval_accuracy")  # the chief's curve
    model_run = client.get_run(tune_study.summary["model"]["mlflow_run_id"])
    best = str(tune_study.summary["best_trial"]["number"])
    assert model_run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert model_run.data.tags["tfdag.tune.trial_run_id"] == trial_runs[best].info.run_id
    version = client.get_model_version(f"{config.name}-model", "1")
    assert version.run_id == model_run.info.run_id


@pytest.mark.slow
def test_the_prefect_flow_run_has_the_trial_table_and_the_progress(tune_study, prefect_api):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from pipeline_lib.config import parse_config

    parent = MlflowClient(tracking_uri=parse_config(tune_study.config).mlflow_uri).get_run(tune_study.summary["mlflow_run_id"])
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[parent.data.tags["prefect_flow_run_id"]])))
    tables = [a for a in artifacts if a.key == "digits-tune-test-tune-trials"]  # one version per finished trial
    assert len(tables) == TRIALS
    rows = json.loads(max(tables, key=lambda a: a.created).data)
    assert sorted(r["trial"] for r in rows) == list(range(TRIALS))
    assert {r["state"] for r in rows} <= {"complete", "pruned"}
    [progress] = [a for a in artifacts if a.key == "digits-tune-test-tune-progress"]
    assert progress.type == "progress" and float(progress.data) == 100.0


def _trial_run_exists(config: dict, number: int) -> bool:
    from mlflow.tracking import MlflowClient

    from pipeline_lib.config import parse_config

    client = MlflowClient(tracking_uri=parse_config(config).mlflow_uri)
    experiment = client.get_experiment_by_name(config["tracking"]["experiment"])
    return experiment is not None and bool(client.search_runs(
        [experiment.experiment_id], f"tags.`tfdag.tune.trial` = '{number}' and attributes.status = 'RUNNING'"))


@pytest.mark.slow
def test_a_study_killed_mid_way_resumes_without_rerunning_finished_trials(tmp_path, tfdag_stack):
    import optuna

    # Two trials: the first finishes, the second is killed while it trains, and the resumed study trains one more.
    config = study_config(tmp_path, "digits-tune-resume", trials=2, parallel=1, pruner="none")
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    states = optuna.trial.TrialState
    process = tune_command(tfdag_stack, path, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            try:
                trials = load_study(config).trials
            except (KeyError, ValueError, FileNotFoundError):  # the study is not created yet
                trials = []
            running_now = [t.number for t in trials if t.state == states.RUNNING]
            # Killed once the running trial trains: its MLflow run exists (a trial is RUNNING in the study a moment
            # before its launch creates that run).
            if (sum(t.state == states.COMPLETE for t in trials) >= 1 and running_now
                    and _trial_run_exists(config, running_now[0])):
                break
            time.sleep(0.5)
        assert process.poll() is None, "the study ended before it could be killed mid-way"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the flow process and its trial's workers, from outside
        process.communicate()
    before = {t.number: t for t in load_study(config).trials}
    finished = {n for n, t in before.items() if t.state == states.COMPLETE}
    running = {n for n, t in before.items() if t.state == states.RUNNING}
    assert len(finished) >= 1 and len(running) == 1

    again = tune_command(tfdag_stack, path)
    output, _ = again.communicate(timeout=900)
    assert again.returncode == 0, output[-5000:]
    after = {t.number: t for t in load_study(config).trials}
    for number in finished:  # not rerun: the same trial, completed at the same moment
        assert after[number].state == states.COMPLETE
        assert after[number].datetime_complete == before[number].datetime_complete
    for number in running:  # the trial the kill interrupted: failed, its budget given to a new one
        assert after[number].state == states.FAIL
    assert sum(t.state == states.COMPLETE for t in after.values()) == 2
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["trials"] == {"complete": 2, "pruned": 0, "failed": 1}
    # One MLflow run per trial; the interrupted trial's run was ended KILLED when the study resumed.
    from mlflow.tracking import MlflowClient

    from pipeline_lib.config import parse_config

    client = MlflowClient(tracking_uri=parse_config(config).mlflow_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    nested = client.search_runs([parent.info.experiment_id],
                                f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=50)
    trial_runs = [r for r in nested if "tfdag.tune.state" in r.data.tags]
    assert sorted(int(r.data.tags["tfdag.tune.trial"]) for r in trial_runs) == sorted(after)
    assert {r.info.status for r in trial_runs if int(r.data.tags["tfdag.tune.trial"]) in running} == {"KILLED"}


@pytest.fixture
def postgres_url() -> str:
    """A throwaway PostgreSQL cluster's URL (tests/postgres.py)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None or importlib.util.find_spec("psycopg2") is None:
        what = ("PostgreSQL (Debian's postgresql, .ci/install-test-deps) or psycopg2 (the dev extra) is missing: the "
                "study on a database server cannot run")
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what}; under CI=true a missing part fails the run")
        pytest.skip(what)
    with postgres_cluster(bin_dir) as url:
        yield url


@pytest.mark.slow
def test_a_hyperband_study_in_postgresql_two_at_a_time_whose_best_model_fails_the_gate_exits_3(
        tmp_path, tfdag_stack, postgres_url):
    import optuna
    import sqlalchemy

    config = study_config(tmp_path, "digits-tune-postgres", trials=5, parallel=2, pruner="hyperband",
                          storage=postgres_url)
    # The learning rate as written (trial 0) and one that learns nothing in 40 steps. With seed 0 the sampler asks
    # [0.002, 1e-7, 0.002, 1e-7, 1e-7]: trial 2 records its step-20 value before trial 4 reaches step 20 (it starts
    # after trial 2 or 3 finished), so Hyperband's first rung (step 20) prunes trial 4 at least.
    config["tune"]["space"] = {"train.base_learning_rate": {"choice": [0.002, 1.0e-7]}}
    config["evaluation"]["gate"] = {"threshold": 1.5}  # no accuracy reaches it
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    process = tune_command(tfdag_stack, path)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 3, output[-5000:]  # as `tfdag run`: the model was not blessed
    summary = json.loads(output.strip().splitlines()[-1])
    assert summary["blessed"] is False and summary["model"]["blessed"] is False
    assert summary["model"]["model_version"] is None
    # The study lives in the database (no journal file), its trials by state as the summary counts them.
    assert not list((tmp_path / "out").rglob("journal.log"))
    trials = load_study(config).trials
    states = optuna.trial.TrialState
    by_state = {"complete": states.COMPLETE, "pruned": states.PRUNED, "failed": states.FAIL}
    assert summary["trials"] == {name: sum(t.state == state for t in trials) for name, state in by_state.items()}
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] == 5 and summary["trials"]["failed"] == 0
    with sqlalchemy.create_engine(postgres_url).connect() as connection:
        assert connection.execute(sqlalchemy.text("select count(*) from trials")).scalar() == 5
    # Two trials wrote to it at once.
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert any(later_start < end for (_, end), (later_start, _) in itertools.pairwise(spans))
    # Hyperband pruned trial 4 (the rate that learns nothing) at its first rung, before the budget.
    assert trials[4].user_attrs["tfdag.params"]["train.base_learning_rate"] == pytest.approx(1.0e-7)
    assert trials[4].state == states.PRUNED, [(t.number, t.state, t.intermediate_values) for t in trials]
    assert max(trials[4].intermediate_values) == 20 < STEPS
    for trial in (t for t in trials if t.state == states.PRUNED):
        result = trial.user_attrs["tfdag.train_result"]
        assert result["pruned"] and result["final_step"] == max(trial.intermediate_values)
    assert summary["best_trial"]["params"]["train.base_learning_rate"] == pytest.approx(0.002)


def test_the_example_study_parses_and_a_config_without_a_tune_section_is_refused_in_one_line(tmp_path):
    from pipeline_lib.config import load_config

    example = load_config(ROOT / "examples" / "digits_tune.yaml")
    assert example.tune is not None and example.tune.trials == 10 and example.tune.parallel == 2
    done = subprocess.run([sys.executable, "-m", "flows.cli", "tune", str(ROOT / "examples" / "digits.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("tfdag:")]
    assert "has no tune: section" in line and "tfdag run" in line
