"""observability.profile_steps: a TensorFlow profiler trace of exactly those steps on the chief, in the run's
TensorBoard directory, that TensorBoard's profile plugin reads (`plugins/profile/<time>/<host>.xplane.pb`); and the
new loop hooks see every execution and checkpoint."""

from __future__ import annotations

import glob
import os

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.training import loop as training
from pipeline_lib.training.hooks import TrainHooks
from tests.conftest import make_plan


class TimingHooks(TrainHooks):
    def __init__(self):
        self.executions, self.checkpoints = [], []

    def on_execution(self, execution):
        self.executions.append((execution.step, execution.steps, execution.examples, execution.seconds,
                                execution.learning_rate))

    def on_checkpoint(self, step, seconds):
        self.checkpoints.append((step, seconds))


def test_a_profiled_run_leaves_a_trace_tensorboard_can_open(tmp_path, shared_manifest):
    config = parse_config({
        "data": {"source": "unused.csv", "label": "label"},
        "model": {"params": {"hidden_units": [16]}},
        "train": {"per_replica_batch_size": 32, "checkpoint_every_steps": 20, "log_every_steps": 10,
                  "steps_per_execution": 4},
        "observability": {"profile_steps": [5, 9]},
    })
    plan = make_plan(shared_manifest, epochs=2)
    hooks = TimingHooks()
    result = training.train(config, shared_manifest, plan, str(tmp_path), hooks=hooks)

    traces = glob.glob(str(tmp_path / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
    # The window's edges are execution boundaries: steps 5..8 ran in executions of their own.
    ends = [step for step, *_ in hooks.executions]
    assert 5 in [end - steps for end, steps, *_ in hooks.executions] and 9 in ends
    assert sum(steps for _, steps, *_ in hooks.executions) == result.final_step == plan.total_steps
    assert all(seconds > 0 and examples == steps * 32 and lr > 0
               for _, steps, examples, seconds, lr in hooks.executions)
    assert [step for step, _ in hooks.checkpoints] == [s for s in range(20, plan.total_steps + 1, 20)] + (
        [plan.total_steps] if plan.total_steps % 20 else [])


def test_profile_steps_must_be_an_increasing_window():
    with pytest.raises(ValueError, match=r"profile_steps \[9, 5\] must be \[start, stop\]"):
        parse_config({"data": {"source": "x.csv", "label": "y"}, "observability": {"profile_steps": [9, 5]}})
