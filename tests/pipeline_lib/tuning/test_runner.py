"""pipeline_lib.tuning.runner: the study's budget, `tune.parallel` trials at once, resume without rerunning finished
trials, failed trials' budget, and one real study on digits with the local launcher in which a trial is pruned.

The fast tests pass `run_study` its own `launch` (the injection point the flow fills with the launcher registry): a
function that reports a fixed accuracy curve as a trial's chief would, and returns its TrainResult.
"""

from __future__ import annotations

import os
import threading

import optuna
import pytest
from optuna.trial import TrialState

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import PipelineConfig, parse_config
from pipeline_lib.core.errors import UserError
from pipeline_lib.launch import launchers
from pipeline_lib.launch.protocol import LaunchOptions
from pipeline_lib.planning.sharding import plan_for_train
from pipeline_lib.training.results import TrainResult
from pipeline_lib.tuning import runner
from pipeline_lib.tuning import study as studies
from pipeline_lib.tuning.pruning import TrialPruning
from pipeline_lib.tuning.runner import TrialStatus, TuningError
from tests.conftest import write_dataset
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    write_digits_dataset,
)
from tests.pipeline_lib.tuning.support import tune_config


@pytest.fixture
def manifest(tmp_path):
    return write_dataset(str(tmp_path / "data"), num_train=64, num_eval=16)


def _result(run_dir: str, curve: dict[int, float]) -> TrainResult:
    final = max(curve)
    return TrainResult(
        run_dir=run_dir, strategy="default", strategy_reason="test", num_workers=1, num_replicas=1,
        per_replica_batch_size=32, global_batch_size=32, base_learning_rate=0.01, scaled_learning_rate=0.01,
        lr_scaling="linear", steps_per_epoch=2, total_steps=final, final_step=final, final_loss=0.1,
        checkpoint_dir=f"{run_dir}/checkpoints", tensorboard_dir=f"{run_dir}/tensorboard",
        checkpoints=tuple(CheckpointRecord(step=step, path=f"{run_dir}/checkpoints/ckpt-{step}",
                                           metrics={"eval_accuracy": value}) for step, value in curve.items()))


class _Launch:
    """Trains nothing: reports the learning rate's accuracy curve through the trial's real pruning rule (as its
    chief does) and returns the TrainResult; `fail` names trial numbers that raise instead."""

    def __init__(self, fail=(), barrier: threading.Barrier | None = None):
        self.fail, self.barrier = set(fail), barrier
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, config: PipelineConfig, run_dir: str, number: int) -> TrainResult:
        with self.lock:
            self.calls.append(number)
        assert config.tune is None and config.tune_trial.trial_number == number
        if self.barrier is not None:
            self.barrier.wait()  # both trials of a parallel pair must be training at once
        if number in self.fail:
            raise RuntimeError(f"worker 0 of trial {number} exited with 1")
        rule = TrialPruning.open(config)
        lr = config.train.base_learning_rate
        curve = {10: lr, 20: 2 * lr}
        for step, value in curve.items():
            rule.observe(step, {"eval_accuracy": value})
        return _result(run_dir, curve)


def test_trials_run_parallel_at_a_time_and_the_best_is_reported(tmp_path, manifest):
    config = tune_config(str(tmp_path), trials=4, parallel=2, seed=1, pruner="none")
    launch = _Launch(barrier=threading.Barrier(2, timeout=30))
    finished = []
    result = runner.run_study(config, manifest, launch=launch, on_trial_finished=finished.append)
    assert sorted(launch.calls) == [0, 1, 2, 3] and sorted(o.number for o in finished) == [0, 1, 2, 3]
    assert result.counts == {"complete": 4, "pruned": 0, "failed": 0}
    assert (result.study, result.metric, result.direction.value) == ("tune-test", "eval_accuracy", "max")
    best = max(result.trials, key=lambda o: o.value)
    assert result.best_number == best.number and result.best_value == best.value
    assert best.value == 2 * best.params["train.base_learning_rate"] and best.best_step == 20
    assert result.best_params == best.params and result.best_result == best.train_result
    assert result.best_config.train.base_learning_rate == best.params["train.base_learning_rate"]
    assert result.best_config.tune_trial.trial_number == best.number
    assert result.best_run_dir == str(tmp_path / "tune" / "tune-test" / f"trial-{best.number}")


def test_a_resumed_study_runs_only_the_rest_of_its_budget(tmp_path, manifest):
    first = runner.run_study(tune_config(str(tmp_path), trials=2, pruner="none"), manifest, launch=_Launch())
    assert first.counts["complete"] == 2
    study = studies.open_study(tune_config(str(tmp_path), trials=2))
    study.ask()  # a trial that was training when its flow was killed
    launch = _Launch()
    again = runner.run_study(tune_config(str(tmp_path), trials=3, pruner="none"), manifest, launch=launch)
    assert launch.calls == [3]  # not 0 and 1 (finished), not 2 (left running): a new trial for its budget
    assert [(o.number, o.state) for o in again.trials] == [
        (0, TrialStatus.COMPLETE), (1, TrialStatus.COMPLETE), (2, TrialStatus.FAILED), (3, TrialStatus.COMPLETE)]
    assert "ended while it trained" in again.trials[2].error
    # What an earlier run finished is reported as it was: params, value, result.
    assert again.trials[0] == first.trials[0]


def test_a_failed_trial_gives_its_budget_to_a_new_one_and_failures_in_a_row_stop_the_study(tmp_path, manifest):
    launch = _Launch(fail={1})
    result = runner.run_study(tune_config(str(tmp_path), trials=2, pruner="none"), manifest, launch=launch)
    assert launch.calls == [0, 1, 2] and result.counts == {"complete": 2, "pruned": 0, "failed": 1}
    assert result.trials[1].error == "RuntimeError: worker 0 of trial 1 exited with 1"
    broken = _Launch(fail=range(100))
    with pytest.raises(TuningError) as error:
        runner.run_study(tune_config(str(tmp_path / "b"), trials=5, pruner="none"), manifest, launch=broken)
    assert broken.calls == [0, 1, 2]
    assert "3 trials failed in a row" in str(error.value) and "trial 2: worker 0 of trial 2 exited" in str(error.value)


def test_a_trial_directory_of_another_study_is_refused(tmp_path, manifest):
    os.makedirs(tmp_path / "tune" / "tune-test" / "trial-0" / "checkpoints")
    with pytest.raises(UserError, match=r"trial-0 already exists, but trial 0 of study 'tune-test' is new"):
        runner.run_study(tune_config(str(tmp_path)), manifest, launch=_Launch())
    assert studies.open_study(tune_config(str(tmp_path))).trials[0].state == TrialState.FAIL


def test_a_dataset_without_an_eval_split_is_refused(tmp_path):
    manifest = write_dataset(str(tmp_path / "data"), num_train=64, num_eval=0)
    with pytest.raises(UserError, match="has no eval split"):
        runner.run_study(tune_config(str(tmp_path)), manifest, launch=_Launch())


@pytest.mark.slow
def test_a_study_on_digits_prunes_a_bad_trial_with_the_local_launcher(tmp_path):
    # Three trials, two at a time, each a supervised worker process. The median pruner waits for 2 complete trials,
    # so the first two (good learning rates, training together) are never pruned; the third (a learning rate that
    # learns nothing) starts when one of them completed and is pruned at its first evaluation after the other did.
    manifest = write_digits_dataset(str(tmp_path / "data"))
    config = parse_config({
        "name": "digits-tune", "data": {"source": "unused.csv", "label": "target"}, "output_root": str(tmp_path),
        "model": {"factory": "mlp", "params": {"hidden_units": [32]}},
        "train": {"steps": 60, "checkpoint_every_steps": 10, "log_every_steps": 10, "hang_timeout_s": 60.0,
                  "early_stopping": {"enabled": False}},
        "preflight": {"enabled": False}, "tracking": {"enabled": False},
        "tune": {"trials": 3, "parallel": 2, "startup_trials": 2,
                 "space": {"train.base_learning_rate": {"loguniform": [1.0e-6, 0.05]}}},
    })
    study = studies.open_study(config)
    for lr in (0.01, 0.02, 1.0e-6):  # the order the trials ask in, so that the bad one runs last
        study.enqueue_trial({"train.base_learning_rate": lr})
    logs = LogCapture()

    def launch(trial_config, run_dir, number):
        plan = plan_for_train(manifest, trial_config.train, 1)
        return launchers.launch_training(trial_config, manifest, plan, run_dir, options=LaunchOptions(log_fn=logs))

    result = runner.run_study(config, manifest, launch=launch)
    assert_no_orphans()  # every trial's worker processes are gone
    assert result.counts == {"complete": 2, "pruned": 1, "failed": 0}, [o.error for o in result.trials]
    pruned = result.trials[2]
    assert pruned.state == TrialStatus.PRUNED and pruned.params == {"train.base_learning_rate": 1.0e-6}
    step = pruned.final_step
    assert step < 60 and step % 10 == 0 and pruned.train_result.total_steps == 60  # fewer steps than its budget
    assert pruned.train_result.pruned and not pruned.train_result.stopped_early
    assert pruned.train_result.stopped_at_step == step
    assert pruned.train_result.stop_reason.startswith(f"pruned by the median pruner at step {step} (trial 2 of "
                                                      "study digits-tune): eval_accuracy")
    stored = optuna.load_study(study_name="digits-tune", storage=studies.create_storage(
        studies.storage_url(config))).trials[2]
    assert stored.state == TrialState.PRUNED and stored.last_step == step
    for complete in result.trials[:2]:
        assert complete.state == TrialStatus.COMPLETE and complete.final_step == 60
        assert not complete.train_result.pruned and complete.value > 0.5
        assert os.path.isfile(os.path.join(complete.run_dir, "result.json"))
    assert result.best_number in (0, 1) and result.best_value == max(o.value for o in result.trials[:2])
