"""Bit-for-bit determinism with shuffling, dropout and Adam: Default in one process and 2-worker
MultiWorkerMirrored over real processes run twice end with identical weights, a worker forked from the fork server
ends with the weights of a training in this process, and an MWMS run SIGKILLed at a step and resumed ends with the
weights of the uninterrupted one. Another thread drawing from Python's `random` meanwhile changes nothing. Equality
is exact (`np.array_equal`), no tolerance."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from pipeline_lib.launch.local import launch
from pipeline_lib.training import loop as training
from tests.pipeline_lib.launch_support import (
    LogCapture,
    assert_no_orphans,
    make_config,
    make_spec,
    model_weights,
    plan_for,
    write_dataset_on_disk,
)

pytestmark = pytest.mark.slow

STEPS = 40
# Shuffling (a buffer smaller than the split, so the order really changes), dropout and Adam: the sources of
# randomness and state that the equivalence test keeps out.
DETERMINISTIC = {"steps": STEPS, "deterministic": True, "shuffle": True, "shuffle_buffer": 100, "optimizer": "adam",
                 "base_learning_rate": 0.01, "checkpoint_every_steps": 21, "log_every_steps": 20, "seed": 11}
MODEL = {"factory": "mlp", "params": {"hidden_units": [16, 8], "dropout": 0.3}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 640 rows: 10 global batches of 64 per epoch, so 40 steps cross 4 epochs (each reshuffled).
    return write_dataset_on_disk(str(tmp_path_factory.mktemp("determinism_data")), num_train=640, num_eval=64)


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    assert_no_orphans()


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b) and a
    different = [key for key in a if not np.array_equal(a[key], b[key])]
    assert not different, {k: float(np.max(np.abs(a[k] - b[k]))) for k in different}


def _final(result) -> dict[str, np.ndarray]:
    assert result.final_step == STEPS and result.checkpoints[-1].step == STEPS
    return model_weights(result.checkpoints[-1].path)


def _mwms(root: str, dataset, **extra):
    config = make_config(root, model=MODEL, strategy="multi_worker_mirrored", workers=2, per_replica_batch_size=32,
                         **DETERMINISTIC, **extra)
    spec = make_spec(config, dataset, plan_for(dataset, config, steps=STEPS), os.path.join(root, "run"))
    return config, spec


@pytest.fixture(scope="module")
def mwms_run(tmp_path_factory, dataset):
    config, spec = _mwms(str(tmp_path_factory.mktemp("mwms_a")), dataset)
    outcome = launch(spec, config, log_fn=LogCapture())
    assert outcome.result.num_workers == 2 and outcome.restarts == ()
    return outcome.result


@pytest.fixture
def another_thread_drawing_from_random():
    """A thread of the process drawing from Python's global `random` throughout (as a server or a retry's jitter
    may): Keras draws its default seeds from the same module, so it must not change what a seeded training builds."""
    stop = threading.Event()

    def draw():
        while not stop.is_set():
            random.random()
            time.sleep(0.0005)

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def test_default_twice_in_one_process_is_bit_identical_and_the_seed_matters(tmp_path, dataset,
                                                                            another_thread_drawing_from_random):
    def run(name: str, seed: int):
        config = make_config(str(tmp_path / name), model=MODEL, strategy="default", per_replica_batch_size=64,
                             **{**DETERMINISTIC, "seed": seed})
        result = training.train(config, dataset, plan_for(dataset, config, steps=STEPS), str(tmp_path / name))
        return _final(result)

    first = run("a", 11)
    assert_bit_identical(first, run("b", 11))
    other_seed = run("c", 12)
    assert any(not np.array_equal(first[k], other_seed[k]) for k in first)


def test_default_forked_from_the_fork_server_is_bit_identical_to_in_process(tmp_path, dataset):
    # The fork server converted the step functions with AutoGraph and froze its objects before forking the worker
    # (`training.prefork`); the worker's training must not differ from one that converted its own.
    def config(name: str):
        return make_config(str(tmp_path / name), model=MODEL, strategy="default", per_replica_batch_size=64,
                           **DETERMINISTIC)

    in_process = training.train(config("a"), dataset, plan_for(dataset, config("a"), steps=STEPS), str(tmp_path / "a"))
    forked = config("b")
    spec = make_spec(forked, dataset, plan_for(dataset, forked, steps=STEPS), str(tmp_path / "b" / "run"))
    outcome = launch(spec, forked, log_fn=LogCapture())
    assert outcome.restarts == () and outcome.result.num_workers == 1
    assert_bit_identical(_final(outcome.result), _final(in_process))


def test_multi_worker_mirrored_twice_is_bit_identical(tmp_path, dataset, mwms_run):
    config, spec = _mwms(str(tmp_path), dataset)
    outcome = launch(spec, config, log_fn=LogCapture())
    assert outcome.restarts == ()
    assert_bit_identical(_final(outcome.result), _final(mwms_run))


def test_multi_worker_mirrored_killed_and_resumed_is_bit_identical(tmp_path, dataset, mwms_run):
    # Checkpoints every 21 steps (at 21 and 40): worker 1 SIGKILLed after step 23, the cluster resumes at 21,
    # mid-epoch 2.
    config, spec = _mwms(str(tmp_path), dataset)
    outcome = launch(spec, config, log_fn=LogCapture(), env={"TFDAG_FAULT": "kill:worker=1:step=23"})
    assert [r.cause for r in outcome.restarts] == ["worker 1 killed by SIGKILL"]
    assert outcome.result.start_step == 21
    assert_bit_identical(_final(outcome.result), _final(mwms_run))
