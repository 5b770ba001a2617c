"""The correctness proof: Default, Mirrored (2 logical CPUs) and MultiWorkerMirrored (2 processes) end with the
same weights; a run SIGKILLed and resumed ends like an uninterrupted one; PS (2 workers, 1 ps) learns digits."""

from __future__ import annotations

import os

import pytest

from pipeline_lib.launch.local import launch
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    max_abs_diff,
    model_weights,
    plan_for,
    write_dataset_on_disk,
    write_digits_dataset,
)

STEPS = 50
GLOBAL_BATCH = 64
TOLERANCE = 1e-5
# SGD, unscaled LR, no shuffle, op determinism: only the distribution differs between the runs. Exactly STEPS steps:
# no early stop (left on, the default patience could end a run sooner). A checkpoint (and its evaluation) every 21
# steps, at 21, 42 and 50: the resume's step 21 and the step-42 check below, without the other five saves.
EQUIVALENCE = {"steps": STEPS, "deterministic": True, "shuffle": False, "optimizer": "sgd",
               "base_learning_rate": 0.1, "lr_scaling": "none", "checkpoint_every_steps": 21, "log_every_steps": 25,
               "seed": 7, "early_stopping": {"enabled": False}}
MODEL = {"factory": "mlp", "params": {"hidden_units": [16, 8]}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 640 rows: 10 global batches of 64 per epoch, so 50 steps cross 5 epochs.
    return write_dataset_on_disk(str(tmp_path_factory.mktemp("equivalence_data")), num_train=640, num_eval=64)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert_no_orphans()


def _final_weights(result) -> dict:
    assert result.final_step == STEPS and result.global_batch_size == GLOBAL_BATCH
    assert result.checkpoints[-1].step == STEPS
    return model_weights(result.checkpoints[-1].path)


def _train_one_worker(root: str, dataset, strategy: str, per_replica: int, replicas: int, **extra):
    """One worker process through the launcher: a fresh TensorFlow runtime for each strategy (collective
    instance keys of MirroredStrategies built in one process collide once their models differ)."""
    config = make_config(root, model=MODEL, strategy=strategy, per_replica_batch_size=per_replica, **EQUIVALENCE,
                         **extra)
    plan = plan_for(dataset, config, steps=STEPS, replicas_per_worker=replicas)
    result = launch(make_spec(config, dataset, plan, os.path.join(root, "run")), config, log_fn=LogCapture()).result
    assert result.num_replicas == replicas and result.strategy == strategy
    return result


def _mwms_config(root: str):
    return make_config(root, model=MODEL, strategy="multi_worker_mirrored", workers=2, per_replica_batch_size=32,
                       **EQUIVALENCE)


@pytest.fixture(scope="module")
def mwms_weights(tmp_path_factory, dataset):
    root = str(tmp_path_factory.mktemp("mwms"))
    config = _mwms_config(root)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=STEPS), os.path.join(root, "run"))
    outcome = launch(spec, config, log_fn=LogCapture())
    assert outcome.result.num_workers == 2 and outcome.result.num_replicas == 2 and outcome.restarts == ()
    return _final_weights(outcome.result)


@pytest.mark.slow
def test_default_mirrored_and_multi_worker_end_with_equal_weights(tmp_path, dataset, mwms_weights):
    default_result = _train_one_worker(str(tmp_path / "default"), dataset, "default", per_replica=64, replicas=1)
    mirrored_result = _train_one_worker(str(tmp_path / "mirrored"), dataset, "mirrored", per_replica=32, replicas=2,
                                        cpu_replicas=2)
    default, mirrored = _final_weights(default_result), _final_weights(mirrored_result)
    # The tolerance means something: the last 8 steps alone move the weights by far more than it.
    step_42 = next(c for c in default_result.checkpoints if c.step == 42)
    assert max_abs_diff(default, model_weights(step_42.path)) > 100 * TOLERANCE
    assert max_abs_diff(default, mirrored) <= TOLERANCE
    assert max_abs_diff(default, mwms_weights) <= TOLERANCE
    assert max_abs_diff(mirrored, mwms_weights) <= TOLERANCE


@pytest.mark.slow
def test_resume_after_a_real_sigkill_ends_with_the_uninterrupted_weights(tmp_path, dataset, mwms_weights):
    # Checkpoints every 21 steps: killed after step 23, resumed from 21, i.e. mid-epoch (position 1 of epoch 2).
    config = _mwms_config(str(tmp_path))
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=STEPS), str(tmp_path / "run"))
    logs = LogCapture()
    outcome = launch(spec, config, log_fn=logs, env={"TFDAG_FAULT": "kill:worker=1:step=23"})
    assert [r.cause for r in outcome.restarts] == ["worker 1 killed by SIGKILL"]
    assert outcome.result.start_step == 21 and outcome.result.final_step == STEPS
    assert max_abs_diff(_final_weights(outcome.result), mwms_weights) <= TOLERANCE


@pytest.mark.slow
def test_parameter_server_with_two_workers_and_one_ps_learns_digits(tmp_path):
    dataset = write_digits_dataset(str(tmp_path / "digits"))
    config = make_config(str(tmp_path), label="target", model={"factory": "mlp", "params": {"hidden_units": [64]}},
                         strategy="parameter_server", workers=2, parameter_servers=1, per_replica_batch_size=32,
                         base_learning_rate=0.005, lr_scaling="none", shuffle=True, checkpoint_every_steps=150,
                         log_every_steps=50, hang_timeout_s=120.0, preflight=True)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=450), str(tmp_path / "run"))
    logs = LogCapture()
    outcome = launch(spec, config, log_fn=logs)
    result = outcome.result
    assert result.strategy == "parameter_server" and result.final_step == 450
    assert any(line.startswith("[ps 0] ") for _, line in logs.lines)
    assert any(line.startswith("[worker 1] ") for _, line in logs.lines)
    accuracy = result.checkpoints[-1].metrics["eval_accuracy"]
    assert accuracy >= 0.9, accuracy
