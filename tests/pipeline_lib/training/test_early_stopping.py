"""Tests for pipeline_lib.training.early_stopping (and its agreement): the patience rule, its config, its state in
the checkpoint across a restart, and the stop every worker agrees on under Default and 2-worker MultiWorkerMirrored.
"""

from __future__ import annotations

import math
import os

import pytest
import tensorflow as tf

from pipeline_lib.checkpoints import selection
from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import (
    ConfigError,
    Direction,
    EarlyStoppingConfig,
    parse_config,
)
from pipeline_lib.training import loop as training
from pipeline_lib.training.early_stopping import (
    EarlyStopping,
    PatienceState,
    early_stopping_metric,
)
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import TrainHooks
from tests.conftest import make_plan
from tests.pipeline_lib.launch_support import (
    make_config,
    make_spec,
    plan_for,
    write_dataset_on_disk,
)


def _config(task="classification", train=None, gate=None):
    return parse_config({"data": {"source": "x.csv", "label": "label"},
                         "model": {"task": task, "params": {"hidden_units": [8]}},
                         "train": train or {}, "evaluation": {"gate": gate or {}}})


def _rule(patience=2, min_delta=0.0, direction=Direction.MIN, every=2, enabled=True):
    config = EarlyStoppingConfig(patience=patience, min_delta=min_delta, enabled=enabled)
    return EarlyStopping(config, "eval_loss", direction, PatienceState(), every)


# --- the rule ------------------------------------------------------------------------------------------------------

def test_patience_counts_evaluations_without_an_improvement_beyond_min_delta():
    rule = _rule(patience=2, min_delta=0.05)
    for step, loss in ((2, 1.0), (4, 0.5), (6, 0.47), (8, 0.47)):
        assert not rule.should_stop
        rule.observe(step, {"eval_loss": loss})
    # 0.47 beat 0.5 by less than min_delta twice: out of patience; the best is the newest of the equal lows.
    assert rule.should_stop and rule.best_step == 8 and rule.best_value == 0.47
    stop = rule.outcome()
    assert stop is not None and stop.best_step == 8
    assert stop.reason == ("eval_loss did not improve by more than 0.05 in 2 evaluation(s) "
                           "(train.early_stopping.patience); best 0.47 at step 8")


def test_an_improvement_resets_patience_and_nan_or_a_missing_metric_never_improves():
    rule = _rule(patience=2, direction=Direction.MAX)
    rule.observe(2, {"eval_loss": 0.5})
    rule.observe(4, {"eval_loss": math.nan})
    rule.observe(6, {"eval_loss": 0.6})  # better (MAX): patience starts again
    rule.observe(8, {"eval_loss": 0.6})
    assert not rule.should_stop and rule.best_step == 8
    rule.observe(10, {"other": 1.0})  # the metric missing: not counted
    assert not rule.should_stop
    rule.observe(12, {"eval_loss": math.nan})
    assert rule.should_stop and rule.best_step == 8


def test_only_evaluations_on_the_cadence_count_and_none_twice():
    rule = _rule(patience=1, every=2)
    rule.observe(2, {"eval_loss": 1.0})
    rule.observe(3, {"eval_loss": 2.0})  # a preemption's save: off the cadence
    rule.observe(2, {"eval_loss": 2.0})  # counted already
    assert not rule.should_stop
    rule.observe(4, {"eval_loss": 2.0})
    assert rule.should_stop


def test_disabled_never_stops():
    rule = _rule(patience=1, enabled=False)
    for step in (2, 4, 6):
        rule.observe(step, {"eval_loss": 1.0})
    assert not rule.should_stop and rule.outcome() is None


def test_the_state_survives_a_checkpoint_and_the_restored_checkpoints_evaluation_is_replayed(tmp_path):
    # The loop writes a checkpoint before evaluating it: the state saved at step 4 predates the evaluation at 4,
    # which the restored run replays from the checkpoint's manifest.
    rule = _rule(patience=2)
    rule.observe(2, {"eval_loss": 1.0})
    prefix = tf.train.Checkpoint(early_stopping=rule.state).write(str(tmp_path / "ckpt-4"))
    rule.observe(4, {"eval_loss": 1.5})
    restored = _rule(patience=2)
    tf.train.Checkpoint(early_stopping=restored.state).read(prefix).assert_consumed()
    restored.replay(CheckpointRecord(step=4, path=prefix, metrics={"eval_loss": 1.5}))
    for evaluated in (rule, restored):
        evaluated.observe(6, {"eval_loss": 1.2})
        assert evaluated.should_stop and evaluated.best_step == 2


# --- the config ----------------------------------------------------------------------------------------------------

def test_defaults_on_with_a_ceiling_of_100_epochs_and_the_gate_metric():
    config = _config()
    assert config.train.epochs == 100
    assert config.train.early_stopping == EarlyStoppingConfig(enabled=True, metric=None, patience=5, min_delta=0.0)
    assert early_stopping_metric(config) == ("eval_accuracy", Direction.MAX)
    assert early_stopping_metric(_config(gate={"metric": "loss"})) == ("eval_loss", Direction.MIN)
    assert early_stopping_metric(_config("regression", gate={"metric": "rmse", "direction": "min"})) == (
        "eval_rmse", Direction.MIN)
    assert early_stopping_metric(_config(train={"early_stopping": {"metric": "loss"}})) == ("eval_loss", Direction.MIN)
    assert early_stopping_metric(_config(train={"early_stopping": {"metric": "accuracy"}},
                                         gate={"metric": "loss"})) == ("eval_accuracy", Direction.MAX)


@pytest.mark.parametrize("task,metric,fits", [
    ("classification", "auc", "['loss', 'accuracy']"),
    ("regression", "accuracy", "['loss', 'mae', 'rmse', 'r2']"),
])
def test_a_metric_the_trainer_does_not_compute_is_a_config_error_naming_it(task, metric, fits):
    with pytest.raises(ConfigError) as error:
        _config(task, train={"early_stopping": {"metric": metric}})
    message = str(error.value)
    assert f"train.early_stopping.metric ('{metric}')" in message and f"model.task {task}" in message
    assert fits in message


# --- the loop ------------------------------------------------------------------------------------------------------

class _Steps(TrainHooks):
    def __init__(self, stop_at=None):
        self.steps, self.stop_at = [], stop_at

    def on_step_end(self, step, examples, loss):
        self.steps.append(step)

    def stop_requested(self):
        return self.stop_at is not None and self.steps[-1] == self.stop_at


def _plateau(shared_manifest, **early_stopping):
    # A learning rate so small the eval loss moves by far less than min_delta: a plateau from the first evaluation.
    # The gate on the loss: early stopping watches it by default, and best-checkpoint selection ranks by it.
    return _config(train={"strategy": "default", "per_replica_batch_size": 32, "base_learning_rate": 1e-7,
                          "checkpoint_every_steps": 2, "log_every_steps": 2, "keep_checkpoints": 1,
                          "early_stopping": {"patience": 2, "min_delta": 1e-3, **early_stopping}},
                   gate={"metric": "loss"})


def test_default_strategy_stops_on_the_plateau_keeps_the_best_checkpoint_and_stays_stopped(tmp_path, shared_manifest):
    config = _plateau(shared_manifest)
    plan = make_plan(shared_manifest, epochs=100)
    hooks = _Steps()
    result = training.train(config, shared_manifest, plan, str(tmp_path), hooks=hooks)
    # Evaluations at 2 (the reference), 4 and 6 (no improvement beyond min_delta): out of patience at 6.
    assert result.stopped_early and result.final_step == result.stopped_at_step == 6 < result.total_steps == 1600
    assert hooks.steps == [1, 2, 3, 4, 5, 6]
    assert result.early_stopping_metric == "eval_loss" and "eval_loss did not improve by more than 0.001" in (
        result.stop_reason)
    # The best step is the one select: best exports (same metric), and retention kept it.
    best = selection.best_checkpoint(result.checkpoints, "eval_loss", Direction.MIN)
    assert best is not None and best.step == result.best_step
    assert result.best_step in (2, 4, 6) and f"at step {result.best_step}" in result.stop_reason

    # Run again on the run_dir: restored where early stopping ended it, it trains nothing and says so again.
    again = training.train(config, shared_manifest, plan, str(tmp_path), hooks=(rerun := _Steps()))
    assert rerun.steps == [] and again.start_step == again.final_step == 6
    assert (again.stopped_early, again.stopped_at_step, again.best_step, again.stop_reason) == (
        True, 6, result.best_step, result.stop_reason)


def test_disabled_trains_to_the_ceiling(tmp_path, shared_manifest):
    config = _plateau(shared_manifest, enabled=False)
    result = training.train(config, shared_manifest, make_plan(shared_manifest, steps=10), str(tmp_path))
    assert not result.stopped_early and result.final_step == 10 and result.stopped_at_step is None
    assert result.early_stopping_metric is None
    assert result.stop_reason == "trained the planned 10 steps (train.early_stopping.enabled: false)"


def test_patience_survives_a_preemption_and_the_resumed_run_stops_where_an_uninterrupted_one_does(
        tmp_path, shared_manifest):
    # patience 3: uninterrupted, the evaluations at 2 (reference), 4, 6, 8 stop it at 8. Preempted right after the
    # evaluation at 4 (its checkpoint holds the state from before it), the resumed run must replay 4 and count on
    # from its checkpoint: stopping at 8 again. Counting afresh would stop at 10.
    config = _plateau(shared_manifest, patience=3)
    plan = make_plan(shared_manifest, epochs=100)
    with pytest.raises(TrainingInterrupted):
        training.train(config, shared_manifest, plan, str(tmp_path), hooks=_Steps(stop_at=4))
    resumed = training.train(config, shared_manifest, plan, str(tmp_path), hooks=(hooks := _Steps()))
    assert resumed.start_step == 4 and hooks.steps == [5, 6, 7, 8]
    assert resumed.stopped_early and resumed.stopped_at_step == 8


# --- two workers ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_mwms_workers_leave_at_the_chiefs_early_stop_step(tmp_path):
    # Two real worker processes over loopback (20 to 45 s, most of it two TensorFlow imports and the collective
    # set-up): the one way to see the all-reduce that carries the chief's decision to the other worker. 4 steps.
    from pipeline_lib.launch.local import launch
    from tests.pipeline_lib.launch_support import LogCapture

    dataset = write_dataset_on_disk(str(tmp_path / "data"), num_train=256, num_eval=64)
    config = make_config(str(tmp_path), workers=2, per_replica_batch_size=16, base_learning_rate=1e-7,
                         checkpoint_every_steps=2, log_every_steps=2,
                         early_stopping={"metric": "loss", "patience": 1, "min_delta": 1e-3})
    run_dir = str(tmp_path / "run")
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=40), run_dir)
    outcome = launch(spec, config, log_fn=LogCapture())
    result = outcome.result
    assert result.strategy == "multi_worker_mirrored" and result.num_workers == 2
    # The evaluation at 2 is the reference, the one at 4 does not improve on it: patience 1 is spent at 4.
    assert result.stopped_early and result.final_step == result.stopped_at_step == 4 < result.total_steps == 40
    assert result.best_step in (2, 4) and f"at step {result.best_step}" in result.stop_reason
    for task in ("worker-0", "worker-1"):
        with open(os.path.join(run_dir, "logs", f"{task}.log")) as handle:
            kept = handle.read()
        assert f"{task.replace('-', ' ')} finished at step 4" in kept
        assert "early stop at step 4 of 40" in kept


def test_a_config_recorded_before_early_stopping_existed_is_rerun_to_its_ceiling():
    import yaml

    from pipeline_lib.reproduce import rerun

    recorded = {"data": {"source": "x.csv", "label": "label"}, "train": {"epochs": 5}}
    assert not rerun._config_from(yaml.safe_dump(recorded), "r1").train.early_stopping.enabled
    recorded["train"]["early_stopping"] = {"patience": 3}
    assert rerun._config_from(yaml.safe_dump(recorded), "r2").train.early_stopping.patience == 3
