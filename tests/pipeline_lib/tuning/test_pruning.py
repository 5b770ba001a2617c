"""pipeline_lib.tuning.pruning: a trial's chief reports each evaluation to the study (another process's view of the
same journal file) and stops, as pruned, when the median pruner says so; a restarted chief reports on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from optuna.trial import TrialState

from pipeline_lib.tuning import runner
from pipeline_lib.tuning import study as studies
from pipeline_lib.tuning.pruning import TrialPruning
from tests.pipeline_lib.launch_support import REPO_ROOT
from tests.pipeline_lib.tuning.support import tune_config

CURVE = {10: 0.5, 20: 0.7, 30: 0.9}  # eval_accuracy of the finished trials at their evaluations


def _study_with_finished_trials(config, count=2):
    study = studies.open_study(config)
    for _ in range(count):
        trial = study.ask()
        for step, value in CURVE.items():
            trial.report(value, step)
        study.tell(trial, max(CURVE.values()))
    return study


def _bound(config, study):
    """A new trial of `study` and its chief's rule, opened from the trial's config as the worker opens it."""
    trial = study.ask()
    trial_config = runner.trial_config(config, {"train.base_learning_rate": 0.01}, trial.number)
    return trial, trial_config, TrialPruning.open(trial_config)


def test_a_trial_below_the_median_is_pruned_at_an_evaluation_on_the_cadence(tmp_path):
    config = tune_config(str(tmp_path), train={"checkpoint_every_steps": 10}, startup_trials=2)
    study = _study_with_finished_trials(config)
    trial, trial_config, rule = _bound(config, study)
    assert trial_config.tune_trial.trial_number == trial.number == 2
    rule.observe(10, {"eval_accuracy": 0.6, "eval_loss": 1.0})  # above the median 0.5: goes on
    assert rule.outcome() is None
    rule.observe(15, {"eval_accuracy": 0.1})  # off the cadence (a preemption's save): reported, not asked
    assert rule.outcome() is None
    rule.observe(20, {"eval_accuracy": 0.3})  # below 0.7
    stop = rule.outcome()
    assert stop is not None and stop.pruned
    assert (stop.best_step, stop.best_value) == (10, 0.6)
    assert stop.reason == ("pruned by the median pruner at step 20 (trial 2 of study tune-test): eval_accuracy 0.3 "
                           "there against the study's other trials; best 0.6 at step 10")
    stored = studies.open_study(config).trials[2]
    assert stored.state == TrialState.RUNNING and stored.intermediate_values == {10: 0.6, 15: 0.1, 20: 0.3}


def test_no_prune_before_the_startup_trials_completed_nor_without_a_pruner(tmp_path):
    config = tune_config(str(tmp_path), train={"checkpoint_every_steps": 10}, startup_trials=3)
    study = _study_with_finished_trials(config, count=2)
    _, _, rule = _bound(config, study)
    rule.observe(10, {"eval_accuracy": 0.0})
    assert rule.outcome() is None  # 2 of 3 startup trials
    without = tune_config(str(tmp_path), train={"checkpoint_every_steps": 10}, startup_trials=0, pruner="none")
    _, _, nothing = _bound(without, study)
    nothing.observe(10, {"eval_accuracy": 0.0})
    assert nothing.outcome() is None


def test_a_restarted_chief_reports_on_without_sending_a_step_twice(tmp_path):
    config = tune_config(str(tmp_path), train={"checkpoint_every_steps": 10})
    study = _study_with_finished_trials(config)
    _, trial_config, first = _bound(config, study)
    first.observe(10, {"eval_accuracy": 0.8})
    restarted = TrialPruning.open(trial_config)  # the group restarted from the checkpoint at step 10
    assert restarted.reported == {10}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns when a step is reported twice
        restarted.observe(10, {"eval_accuracy": 0.8})
        restarted.observe(20, {"eval_accuracy": 0.85})
    assert restarted.outcome() is None
    assert studies.open_study(config).trials[2].intermediate_values == {10: 0.8, 20: 0.85}


def test_a_config_without_a_binding_opens_no_pruner(tmp_path):
    with pytest.raises(ValueError, match="has no tune_trial"):
        TrialPruning.open(tune_config(str(tmp_path)))


def test_only_a_trials_chief_loads_the_tuning_package_and_optuna(tmp_path):
    # A fresh interpreter: the worker module, a plain run's config, and a trial's config on a non-chief worker.
    code = textwrap.dedent(f"""
        import sys
        from pipeline_lib.cluster.info import ClusterInfo
        from pipeline_lib.config import parse_config
        from pipeline_lib.launch import launchers, worker
        base = {{"data": {{"source": "x.csv", "label": "y"}}, "output_root": {str(tmp_path)!r}}}
        assert worker._create_pruning(parse_config(base), ClusterInfo()) is None
        binding = {{"storage": "/nowhere/journal.log", "study": "s", "trial_number": 0, "metric": "eval_accuracy",
                    "direction": "max"}}
        other = ClusterInfo(task_type="worker", task_index=1, cluster={{"worker": ("a:1", "b:2")}})
        assert worker._create_pruning(parse_config({{**base, "tune_trial": binding}}), other) is None
        print(sorted(m for m in sys.modules if m.split(".")[0] == "optuna" or m.startswith("pipeline_lib.tuning")))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
