"""Tests for pipeline_lib.training.loop: the custom loop under Default, Mirrored, MWMS and PS; exact resume."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from pipeline_lib.checkpoints import manifests
from pipeline_lib.config import parse_config
from pipeline_lib.core.net import free_ports
from pipeline_lib.testing.sinks import InMemorySink
from pipeline_lib.training import loop as training
from pipeline_lib.training.errors import TrainingError, TrainingInterrupted
from pipeline_lib.training.hooks import TrainHooks
from tests.conftest import make_plan, write_dataset
from tests.pipeline_lib.launch_support import REPO_ROOT
from tests.pipeline_lib.tensorboard_support import read_scalars

pytestmark = pytest.mark.slow

# tests/pipeline_lib/training/test_loop.py -> the repository root, for the worker processes' PYTHONPATH.


def _config(**train):
    model = train.pop("model", {"params": {"hidden_units": [16]}})
    values = {"per_replica_batch_size": 32, "base_learning_rate": 0.01, "checkpoint_every_steps": 20,
              "log_every_steps": 10, "lr_scaling": "none"}
    values.update(train)
    return parse_config({"data": {"source": "unused.csv", "label": "label"}, "model": model, "train": values})


def _weights(run_dir, config, manifest):
    """The trained weights, restored through the model key alone from the newest checkpoint."""
    import tensorflow as tf

    from pipeline_lib.training import models

    record = manifests.latest_valid(os.path.join(run_dir, "checkpoints"))
    model = models.create_model(config.model, manifest.feature_schema)
    tf.train.Checkpoint(model=model).read(record.path).expect_partial()
    return [w.numpy() for w in model.weights]


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


class RecordingHooks(TrainHooks):
    def __init__(self, stop_at=None):
        self.steps, self.stop_at, self.inputs_done = [], stop_at, []

    def input_done(self, iterator):
        self.inputs_done.append(iterator)

    def on_step_end(self, step, examples, loss):
        self.steps.append((step, examples, loss))

    def on_restored(self, step):
        self.phases = [("restored", step)]

    def on_phase(self, phase, step):
        self.phases.append((phase.value, step))

    def stop_requested(self):
        return self.stop_at is not None and bool(self.steps) and self.steps[-1][0] >= self.stop_at


@pytest.mark.parametrize("strategy,cpu_replicas", [("default", None), ("mirrored", 2)])
def test_loss_falls_and_every_planned_step_runs(tmp_path, shared_manifest, strategy, cpu_replicas, caplog,
                                                no_op_determinism):
    replicas = cpu_replicas or 1
    config = _config(strategy=strategy, cpu_replicas=cpu_replicas, steps_per_execution=3)
    plan = make_plan(shared_manifest, replicas_per_worker=replicas, epochs=4)
    sink, hooks = InMemorySink(), RecordingHooks()
    with caplog.at_level(logging.INFO, logger="pipeline_lib.training.progress"):
        result = training.train(config, shared_manifest, plan, str(tmp_path), metrics_sink=sink, hooks=hooks)
    assert result.strategy == strategy and result.num_replicas == replicas
    assert result.global_batch_size == 32 * replicas
    assert result.final_step == plan.total_steps == result.total_steps
    assert [s for s, _, _ in hooks.steps] == list(range(1, plan.total_steps + 1))
    assert [hasattr(i, "get_next") for i in hooks.inputs_done] == [True]  # the iterator, handed over once at the end
    assert all(examples == 32 * replicas for _, examples, _ in hooks.steps)
    losses = [loss for _, _, loss in hooks.steps]
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])
    logged = sorted(set(range(10, plan.total_steps + 1, 10)) | {plan.total_steps})
    assert [step for step, _ in sink.series("loss")] == logged
    assert {"loss", "learning_rate", "examples_per_sec", "steps_per_sec", "step_seconds", "input_wait_seconds",
            "gradient_norm"} <= set(sink.history[0][1])
    assert "train | step:     10 | steps/sec:" in caplog.text
    assert os.listdir(result.tensorboard_dir)
    assert result.checkpoints[-1].step == plan.total_steps
    assert set(result.checkpoints[-1].metrics) == {"eval_loss", "eval_accuracy", "train_loss"}
    assert [step for step, _ in sink.series("eval_loss")] == sorted(
        set(range(20, plan.total_steps + 1, 20)) | {plan.total_steps})
    assert sink.series("eval_accuracy")[-1][1] > 0.7


def test_default_and_mirrored_end_with_equal_weights(tmp_path):
    manifest = write_dataset(str(tmp_path / "data"), num_train=640, num_eval=64)
    runs = {}
    for name, strategy, cpu_replicas, per_replica in (("default", "default", None, 64),
                                                       ("mirrored", "mirrored", 2, 32)):
        config = _config(strategy=strategy, cpu_replicas=cpu_replicas, per_replica_batch_size=per_replica,
                         shuffle=False, deterministic=True, steps=50, checkpoint_every_steps=50,
                         base_learning_rate=0.005)
        plan = make_plan(manifest, replicas_per_worker=cpu_replicas or 1, per_replica_batch_size=per_replica,
                         steps=50)
        assert plan.global_batch_size == 64 and plan.total_steps == 50
        result = training.train(config, manifest, plan, str(tmp_path / name))
        assert result.final_step == 50
        runs[name] = _weights(str(tmp_path / name), config, manifest)
    assert _max_diff(runs["default"], runs["mirrored"]) < 1e-5


@pytest.mark.parametrize("strategy,cpu_replicas,seed", [("default", None, 42), ("mirrored", 2, 42), ("default", None, 0)])
def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, shared_manifest, strategy, cpu_replicas, seed):
    replicas = cpu_replicas or 1
    config = _config(strategy=strategy, cpu_replicas=cpu_replicas, shuffle=True, shuffle_buffer=64, seed=seed,
                     deterministic=True, checkpoint_every_steps=8, steps_per_execution=2,
                     model={"params": {"hidden_units": [16], "dropout": 0.2}})
    plan = make_plan(shared_manifest, replicas_per_worker=replicas, epochs=3)
    steps_per_epoch = plan.steps_per_epoch
    stop_at = steps_per_epoch + 3  # mid-epoch, between checkpoints
    whole = training.train(config, shared_manifest, plan, str(tmp_path / "whole"))

    resumed_dir = str(tmp_path / "resumed")
    stopping = RecordingHooks(stop_at=stop_at)
    with pytest.raises(TrainingInterrupted) as stopped:
        training.train(config, shared_manifest, plan, resumed_dir, hooks=stopping)
    assert stopped.value.step == stop_at + (stop_at % 2)
    assert len(stopping.inputs_done) == 1  # an interrupted loop hands its iterator over too
    hooks = RecordingHooks()
    result = training.train(config, shared_manifest, plan, resumed_dir, hooks=hooks)
    assert result.start_step == stopped.value.step
    assert hooks.steps[0][0] == stopped.value.step + 1 and result.final_step == plan.total_steps
    assert len(hooks.steps) == plan.total_steps - stopped.value.step
    assert abs(result.final_loss - whole.final_loss) < 1e-5
    assert _max_diff(_weights(str(tmp_path / "whole"), config, shared_manifest),
                     _weights(resumed_dir, config, shared_manifest)) < 1e-5


def test_steps_per_execution_does_not_change_the_result(tmp_path, tiny_manifest):
    plan = make_plan(tiny_manifest, epochs=2)
    weights = []
    for spe in (1, 5):
        config = _config(strategy="default", deterministic=True, shuffle=True, steps_per_execution=spe)
        training.train(config, tiny_manifest, plan, str(tmp_path / f"spe{spe}"))
        weights.append(_weights(str(tmp_path / f"spe{spe}"), config, tiny_manifest))
    assert _max_diff(*weights) < 1e-6


def test_finished_run_restarts_as_a_no_op_with_its_checkpoints_result(tmp_path, tiny_manifest):
    config = _config(strategy="default", checkpoint_every_steps=3)
    plan = make_plan(tiny_manifest, epochs=1)
    first_hooks = RecordingHooks()
    first = training.train(config, tiny_manifest, plan, str(tmp_path), hooks=first_hooks)
    total = plan.total_steps
    # The phases the watchdog bounds: a save between steps, then the finish (with the final save) at the end.
    assert first_hooks.phases[:4] == [("restored", 0), ("stepping", 0), ("saving", 3), ("stepping", 3)]
    assert first_hooks.phases[-1] == ("finishing", total)
    record = manifests.latest_valid(str(tmp_path / "checkpoints"))
    assert record.step == total and record.metrics["train_loss"] == pytest.approx(first.final_loss)
    hooks = RecordingHooks()
    again = training.train(config, tiny_manifest, plan, str(tmp_path), hooks=hooks)
    assert again.start_step == again.final_step == total and hooks.steps == []
    assert hooks.phases == [("restored", total), ("finishing", total)]
    # The loss of the last step, from the checkpoint's record: the result survives its JSON round trip.
    assert again.final_loss == pytest.approx(first.final_loss)
    assert type(again).model_validate_json(again.model_dump_json()).final_loss == pytest.approx(first.final_loss)


def test_regression_with_warmup_and_mixed_precision(tmp_path):
    manifest = write_dataset(str(tmp_path / "data"), num_train=256, task="regression")
    config = parse_config({"data": {"source": "x.csv", "label": "label"},
                           "model": {"task": "regression", "params": {"hidden_units": [16]}},
                           "train": {"strategy": "default", "warmup_steps": 5, "mixed_precision": True,
                                     "base_learning_rate": 0.01, "checkpoint_every_steps": 16,
                                     "log_every_steps": 4}})
    sink = InMemorySink()
    result = training.train(config, manifest, make_plan(manifest, epochs=4), str(tmp_path / "run"),
                            metrics_sink=sink)
    assert np.isfinite(result.final_loss)
    assert "eval_mae" in result.checkpoints[-1].metrics
    assert sink.series("learning_rate")[0][1] < sink.series("learning_rate")[-1][1] == pytest.approx(0.01)


def test_plan_for_another_cluster_is_rejected(tmp_path, tiny_manifest):
    config = _config(strategy="mirrored", cpu_replicas=2)
    with pytest.raises(TrainingError, match=r"global_batch_size \(32\) .* 2 replica"):
        training.train(config, tiny_manifest, make_plan(tiny_manifest, replicas_per_worker=1), str(tmp_path))


def test_short_data_for_the_plan_is_rejected(tmp_path, tiny_manifest):
    plan = make_plan(tiny_manifest).model_copy(update={"steps_per_epoch": 100, "total_steps": 100})
    with pytest.raises(TrainingError, match="needs 100"):
        training.train(_config(strategy="default"), tiny_manifest, plan, str(tmp_path))


WORKER_SOURCE = '''
import json, os, sys
from pipeline_lib.training import loop as training
from pipeline_lib.training.errors import TrainingInterrupted
from pipeline_lib.training.hooks import TrainHooks
from pipeline_lib.config import parse_config
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan

args = json.loads(sys.argv[1])
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


class Hooks(TrainHooks):
    step = 0

    def on_step_end(self, step, examples, loss):
        self.step = step

    def stop_requested(self):
        return index == args.get("stop_worker") and self.step >= args["stop_at"]


try:
    result = training.train(parse_config(args["config"]), Manifest.model_validate_json(args["manifest"]),
                            ShardPlan.model_validate_json(args["plan"]), args["run_dir"], hooks=Hooks())
    print("RESULT", json.dumps({"final_step": result.final_step, "start_step": result.start_step,
                                "is_chief": result.is_chief, "checkpoints": len(result.checkpoints)}))
except TrainingInterrupted as stopped:
    print("INTERRUPTED", stopped.step)
    sys.exit(3)
'''


def _run_workers(tmp_path, args, num_workers=2):
    """Start real MultiWorkerMirrored worker processes over loopback; return (exit codes, outputs)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(WORKER_SOURCE)
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    procs = []
    try:
        for index in range(num_workers):
            env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                       TF_CONFIG=json.dumps({"cluster": {"worker": addresses},
                                             "task": {"type": "worker", "index": index}}))
            procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(args)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
        return [proc.returncode for proc in procs], outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_multi_worker_matches_default_and_stops_together(tmp_path):
    """MWMS with 2 worker processes (32 each) equals Default (64); a stop asked of worker 1 stops both."""
    manifest = write_dataset(str(tmp_path / "data"), num_train=640, num_eval=64)
    # 30 steps (3 epochs), a checkpoint every 10, worker 1 asks to stop after step 13: mid-epoch, between checkpoints.
    common = {"shuffle": False, "deterministic": True, "steps": 30, "checkpoint_every_steps": 10,
              "base_learning_rate": 0.005}
    default_config = _config(strategy="default", per_replica_batch_size=64, **common)
    training.train(default_config, manifest, make_plan(manifest, per_replica_batch_size=64, steps=30),
                   str(tmp_path / "default"))
    config = _config(strategy="multi_worker_mirrored", per_replica_batch_size=32, **common)
    plan = make_plan(manifest, num_workers=2, per_replica_batch_size=32, steps=30)
    args = {"config": config.model_dump(mode="json"), "manifest": manifest.to_json(),
            "plan": plan.model_dump_json(), "run_dir": str(tmp_path / "mwms"), "stop_worker": 1, "stop_at": 13}

    codes, outputs = _run_workers(tmp_path, args)
    assert codes == [3, 3], outputs
    assert all("INTERRUPTED 13" in out for out in outputs)
    assert [r.step for r in manifests.list_checkpoints(str(tmp_path / "mwms" / "checkpoints"))] == [10, 13]

    args.pop("stop_worker")
    codes, outputs = _run_workers(tmp_path, args)
    assert codes == [0, 0], outputs
    assert '"final_step": 30, "start_step": 13, "is_chief": true, "checkpoints": 3' in outputs[0]
    assert '"is_chief": false, "checkpoints": 0' in outputs[1]
    assert not os.listdir(tmp_path / "mwms" / "checkpoints" / ".scratch")
    assert _max_diff(_weights(str(tmp_path / "default"), default_config, manifest),
                     _weights(str(tmp_path / "mwms"), config, manifest)) < 1e-5


PS_TASK_SOURCE = '''
import json, sys
from pipeline_lib.training import loop as training
from pipeline_lib.cluster.info import cluster_from_env
from pipeline_lib.config import parse_config
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan

cluster = cluster_from_env()
if cluster.task_type != "chief":
    training.run_server(cluster)
args = json.loads(sys.argv[1])
result = training.train(parse_config(args["config"]), Manifest.model_validate_json(args["manifest"]),
                        ShardPlan.model_validate_json(args["plan"]), args["run_dir"], cluster=cluster)
print("RESULT", json.dumps({"final_step": result.final_step, "num_workers": result.num_workers,
                            "accuracy": result.checkpoints[-1].metrics["eval_accuracy"]}))
'''


def test_parameter_server_chief_coordinates_two_workers_and_one_ps(tmp_path):
    import json
    import subprocess
    import sys

    manifest = write_dataset(str(tmp_path / "data"), num_train=640, num_eval=128)
    config = _config(strategy="parameter_server", workers=2, parameter_servers=1, steps=60,
                     checkpoint_every_steps=30)
    args = {"config": config.model_dump(mode="json"), "manifest": manifest.to_json(),
            "plan": make_plan(manifest, steps=60).model_dump_json(), "run_dir": str(tmp_path / "ps")}
    chief, ps, *workers = (f"127.0.0.1:{port}" for port in free_ports(4))
    cluster = {"chief": [chief], "ps": [ps], "worker": workers}
    script = tmp_path / "task.py"
    script.write_text(PS_TASK_SOURCE)
    procs = []
    try:
        for job in ("chief", "ps", "worker"):
            for index in range(len(cluster[job])):
                env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                           TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}))
                procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(args)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        output = procs[0].communicate(timeout=300)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert procs[0].returncode == 0, output
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert result["final_step"] == 60 and result["num_workers"] == 2
    assert result["accuracy"] > 0.7
    assert [r.step for r in manifests.list_checkpoints(str(tmp_path / "ps" / "checkpoints"))] == [30, 60]
    # The coordinator fetched each scheduled step's gradient norm and input wait.
    scalars = read_scalars(str(tmp_path / "ps" / "tensorboard"))
    assert [step for step, _ in scalars["gradient_norm"]] == [10, 20, 30, 40, 50, 60]
    assert all(0 < norm < float("inf") for _, norm in scalars["gradient_norm"])
    assert all(0 <= wait < step for (_, wait), (_, step) in zip(scalars["input_wait_seconds"],
                                                                 scalars["step_seconds"]))
