"""Tests for pipeline_lib.training.controller: executions bounded by log and checkpoint steps, stop requests, the
points the loop's actions run at, a tuning trial's prune (and the agreement that carries it)."""

from __future__ import annotations

import types

import pytest
import tensorflow as tf

from pipeline_lib.checkpoints.records import CheckpointRecord
from pipeline_lib.config import Direction, TrainConfig
from pipeline_lib.planning.batch import create_batch_scaling
from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.actions.preemption import SaveCheckpointIfPreempted
from pipeline_lib.training.actions.pruning import PruneTrial
from pipeline_lib.training.agreement import GroupStop, StopAgreement
from pipeline_lib.training.controller import LoopController
from pipeline_lib.training.early_stopping import EarlyStop
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import TrainHooks
from pipeline_lib.training.step import StepOutputs


def _outputs(count, loss=0.5):
    """`count` steps' outputs: the loss, a gradient norm and an input wait per step."""
    return StepOutputs([loss] * count, [2.0 + i for i in range(count)], [0.001] * count)


class _Store:
    best_metric, best_direction = "eval_accuracy", Direction.MAX

    def __init__(self):
        self.saved = []

    def save(self, step, metrics_fn=None, data_position=None):
        metrics = metrics_fn() if metrics_fn is not None else {}
        self.saved.append(step)
        return CheckpointRecord(step=step, path=f"/run/checkpoints/ckpt-{step}", metrics=metrics,
                                data_position=data_position)


class _Progress:
    def __init__(self):
        self.logged, self.evals, self.executions = [], [], []

    def record(self, execution):
        self.executions.append(execution)

    def log(self, step, loss, learning_rate):
        self.logged.append(step)

    def log_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def flush_summaries(self):
        pass

    def close(self):
        pass


class _Hooks(TrainHooks):
    def __init__(self):
        self.steps = []

    def on_step_end(self, step, examples, loss):
        self.steps.append((step, examples))


def _controller(start_step=0, total_steps=25, actions=()):
    state = types.SimpleNamespace(
        start_step=start_step, restored=None, optimizer=types.SimpleNamespace(learning_rate=0.1), store=_Store(),
        step_var=types.SimpleNamespace(assign=lambda value: None),
        run_storage=types.SimpleNamespace(is_remote=False, tensorboard_sync=None, local_checkpoint_dir="/run/ckpt"))
    config = TrainConfig(log_every_steps=4, checkpoint_every_steps=10)
    hooks, progress = _Hooks(), _Progress()
    attempt = create_batch_scaling(per_replica_batch=64, num_workers=1, replicas_per_worker=1, base_learning_rate=0.1,
                                   lr_scaling="linear")
    controller = LoopController(config, total_steps, attempt, state, hooks, progress, lambda: {"eval_accuracy": 0.5},
                                actions=[SaveCheckpointIfPreempted(), *actions])
    return controller, state, hooks, progress


def test_executions_stop_at_log_checkpoint_and_end_steps():
    controller, state, hooks, progress = _controller()
    ran = []
    while controller.step < controller.total_steps:
        count = controller.steps_to_next(100)
        ran.append(count)
        controller.after_execution(_outputs(count), lambda early: GroupStop())
    controller.finish()
    assert ran == [4, 4, 2, 2, 4, 4, 4, 1]
    assert progress.logged == [4, 8, 12, 16, 20, 24, 25]
    assert state.store.saved == [10, 20, 25]
    assert progress.evals[0] == (10, {"eval_accuracy": 0.5})
    assert hooks.steps == [(s, 64) for s in range(1, 26)]
    # Every execution reaches the progress logger with its per-step measurements.
    assert [e.steps for e in progress.executions] == ran
    first = progress.executions[0]
    assert (first.step, first.examples, first.loss, first.learning_rate) == (4, 256, 0.5, 0.1)
    assert first.gradient_norms == (2.0, 3.0, 4.0, 5.0) and first.gradient_norm == 3.5
    assert first.input_waits_s == (0.001,) * 4 and first.seconds > 0


def test_a_stop_request_saves_the_step_then_interrupts():
    controller, state, _, _ = _controller()
    controller.after_execution(_outputs(3), lambda early: GroupStop())
    with pytest.raises(TrainingInterrupted) as stopped:
        controller.after_execution(_outputs(2), lambda early: GroupStop(requested=True))
    assert stopped.value.step == 5 and stopped.value.checkpoint_path == "/run/checkpoints/ckpt-5"
    assert state.store.saved == [5]


def test_a_resumed_run_does_not_save_its_start_step_again():
    controller, state, _, _ = _controller(start_step=25)
    controller.finish()
    assert state.store.saved == []


class _Recorder(LoopAction):
    """An action that notes each point it is run at and ends executions at step 7."""

    def __init__(self, start_stop=None):
        self.seen, self.start_stop = [], start_stop

    def on_start(self, step, restored):
        self.seen.append(("start", step))
        return self.start_stop

    def next_boundary(self, step):
        return 7 if step < 7 else None

    def after_execution(self, execution):
        self.seen.append(("execution", execution.step))

    def after_log(self, step):
        self.seen.append(("log", step))

    def before_save(self, step):
        self.seen.append(("save", step))

    def on_evaluation(self, step, metrics):
        self.seen.append(("evaluation", step))

    def close(self):
        self.seen.append(("close", None))


def test_an_action_runs_at_each_point_and_its_boundary_ends_an_execution():
    action = _Recorder()
    controller, state, _, _ = _controller(total_steps=12, actions=[action])
    ran = []
    while not controller.is_done:
        ran.append(controller.steps_to_next(100))
        controller.after_execution(_outputs(ran[-1]), lambda early: GroupStop())
    controller.finish()
    controller.close()
    assert ran == [4, 3, 1, 2, 2] and state.store.saved == [10, 12]
    assert action.seen == [("start", 0), ("execution", 4), ("log", 4), ("execution", 7), ("execution", 8),
                           ("log", 8), ("execution", 10), ("save", 10), ("evaluation", 10), ("execution", 12),
                           ("log", 12), ("save", 12), ("evaluation", 12), ("close", None)]


def test_a_stop_an_action_finds_at_the_start_ends_the_loop_before_any_step():
    stop = EarlyStop(20, 0.5, "patience ran out at step 20")
    controller, state, _, _ = _controller(start_step=20, total_steps=50, actions=[_Recorder(start_stop=stop)])
    assert controller.is_done and controller.early_stop == stop
    controller.finish()
    assert state.store.saved == []


# --- a tuning trial's pruner (a StopRule) ----------------------------------------------------------------------------

class _PruneAt:
    """A stop rule that prunes at its first evaluation at or after step `at`."""

    def __init__(self, at):
        self.at, self.seen, self.stop = at, [], None

    def observe(self, step, metrics):
        self.seen.append(step)
        if step >= self.at and self.stop is None:
            self.stop = EarlyStop(step, metrics["eval_accuracy"], f"pruned at step {step}", pruned=True)

    def outcome(self):
        return self.stop


def test_a_prune_ends_training_at_the_agreed_evaluation_like_an_early_stop():
    rule = _PruneAt(20)
    controller, state, _, _ = _controller(total_steps=50, actions=[PruneTrial(rule)])
    agree = StopAgreement(types.SimpleNamespace(num_workers=1), TrainHooks())  # one worker: nothing exchanged
    while not controller.is_done:
        controller.after_execution(_outputs(controller.steps_to_next(100)), agree)
    assert controller.step == 20 and state.store.saved == [10, 20] and rule.seen == [10, 20]
    stop = controller.early_stop
    assert stop == EarlyStop(20, 0.5, "pruned at step 20", pruned=True)


def test_a_worker_that_did_not_prune_records_the_agreed_prune():
    controller, _, _, _ = _controller(total_steps=50)
    controller.after_execution(_outputs(4), lambda early: GroupStop())
    for count in (4, 2):
        controller.after_execution(_outputs(count), lambda early: GroupStop(early=True, best_step=10, best_value=0.5,
                                                                           pruned=True))
    assert controller.is_done and controller.step == 10
    assert controller.early_stop == EarlyStop(
        10, 0.5, "pruned by the tuning trial's pruner at step 10; best 0.5 at step 10", pruned=True)


def test_the_group_agrees_on_the_chiefs_prune_in_one_all_reduce():
    # Two replicas of one process stand in for two workers: every replica's flags add up, the chief's (first
    # replica's) step, value and pruned flag come through exactly.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    agree = StopAgreement(types.SimpleNamespace(strategy=strategy, num_workers=2), TrainHooks())
    assert agree(None) == GroupStop()
    assert agree(EarlyStop(40, 0.25, "pruned", pruned=True)) == GroupStop(False, True, 40, 0.25, True)
    assert agree(EarlyStop(30, 0.5, "patience")) == GroupStop(False, True, 30, 0.5, False)
