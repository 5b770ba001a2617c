"""Shared test set-up: 2 logical CPU devices (before TensorFlow initialises) and tiny generated datasets."""

from __future__ import annotations

import hashlib
import os
import random
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite's own cache root (staged shards and the like), new for every test process: no test reads what an earlier
# session left under ~/.cache/tfdag. Servers and workers started by the tests inherit it.
os.environ.setdefault("TFDAG_CACHE_DIR", tempfile.mkdtemp(prefix="tfdag-test-cache-"))

import numpy as np
import pytest
import tensorflow as tf

# Split the CPU into 2 logical devices now: it is impossible once TensorFlow has initialised,
# and Mirrored tests need 2 replicas on CPU-only machines.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

from pipeline_lib.data.manifest import (
    DType,
    FeatureSpec,
    Manifest,
    Schema,
    ShardInfo,
    SourceFingerprint,
)
from pipeline_lib.planning.sharding import AutoShardPolicy, ShardPlan, WorkerAssignment
from tests.servers import mlflow_client, prefect_api, tfdag_stack  # noqa: F401  (session fixtures for every folder)

NUM_CLASSES = 3


def _example(x: np.ndarray, size: float, color: str, label) -> bytes:
    feature = {
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x.tolist())),
        "size": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(size)])),
        "color": tf.train.Feature(bytes_list=tf.train.BytesList(value=[color.encode()])),
    }
    if isinstance(label, float):
        feature["label"] = tf.train.Feature(float_list=tf.train.FloatList(value=[label]))
    else:
        feature["label"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def generate_rows(num_rows: int, seed: int, task: str = "classification") -> list[dict]:
    """Learnable rows: x (4 floats), size (int), color (string) and a label that depends on them."""
    rng = np.random.default_rng(seed)
    colors = ["red", "green", "blue"]
    weights = np.array([[1.5, -1.0, 0.5], [-0.5, 1.0, 1.0], [1.0, 0.5, -1.5], [0.0, -1.0, 1.0]])
    rows = []
    for _ in range(num_rows):
        x = rng.normal(size=4).astype(np.float32)
        size = int(rng.integers(0, 5))
        color = colors[int(rng.integers(0, 3))]
        if task == "classification":
            label = int(np.argmax(x @ weights))
        else:
            label = float(x @ weights[:, 0] + 0.1 * size)
        rows.append({"x": x, "size": size, "color": color, "label": label})
    return rows


def write_dataset(root: str, *, num_train: int = 256, num_eval: int = 64, num_train_shards: int = 1,
                  compression: str = "none", task: str = "classification", seed: int = 0) -> Manifest:
    """Write train/eval TFRecord shards with the plain TF writer and return their Manifest."""
    os.makedirs(root, exist_ok=True)
    suffix = ".tfrecord.gz" if compression == "gzip" else ".tfrecord"
    options = tf.io.TFRecordOptions(compression_type="GZIP" if compression == "gzip" else "")
    shards = []
    for split, count, num_shards, split_seed in (("train", num_train, num_train_shards, seed),
                                                  ("eval", num_eval, 1, seed + 1)):
        rows = generate_rows(count, split_seed, task)
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for index in range(num_shards):
            part = rows[index::num_shards] if num_shards > 1 else rows
            relative = f"{split}/part-{index:05d}-of-{num_shards:05d}{suffix}"
            path = os.path.join(root, relative)
            with tf.io.TFRecordWriter(path, options) as writer:
                for row in part:
                    writer.write(_example(row["x"], row["size"], row["color"], row["label"]))
            with open(path, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
            shards.append(ShardInfo(split=split, path=relative, num_records=len(part),
                                    num_bytes=os.path.getsize(path), sha256=digest))
    label_dtype = DType.INT64 if task == "classification" else DType.FLOAT32
    schema = Schema(
        features=(FeatureSpec(name="x", dtype=DType.FLOAT32, shape=(4,)),
                  FeatureSpec(name="size", dtype=DType.INT64),
                  FeatureSpec(name="color", dtype=DType.STRING)),
        label=FeatureSpec(name="label", dtype=label_dtype),
        num_classes=NUM_CLASSES if task == "classification" else None,
    )
    return Manifest(fingerprint="test", dataset_uri=root, feature_schema=schema, shards=tuple(shards),
                    source=SourceFingerprint(files=(), sha256="0" * 64), compression=compression)


def make_plan(manifest: Manifest, *, num_workers: int = 1, replicas_per_worker: int = 1,
              per_replica_batch_size: int = 32, epochs: int = 1, steps: int | None = None,
              policy: AutoShardPolicy = AutoShardPolicy.DATA) -> ShardPlan:
    """A ShardPlan built by hand (independent of the planner module)."""
    files = tuple(s.path for s in manifest.shards_for("train"))
    total = manifest.num_records("train")
    global_batch = per_replica_batch_size * replicas_per_worker * num_workers
    if policy == AutoShardPolicy.FILE:
        assignments = tuple(
            WorkerAssignment(worker_index=w, files=files[w::num_workers],
                             num_records=sum(s.num_records for s in manifest.shards_for("train")[w::num_workers]))
            for w in range(num_workers))
        per_worker = min(a.num_records for a in assignments)
        steps_per_epoch = per_worker // (per_replica_batch_size * replicas_per_worker)
    else:
        assignments = tuple(WorkerAssignment(worker_index=w, files=files, num_records=total // num_workers)
                            for w in range(num_workers))
        steps_per_epoch = total // global_batch
    total_steps = steps if steps is not None else steps_per_epoch * epochs
    if steps is not None:
        epochs = -(-steps // steps_per_epoch)
    return ShardPlan(policy=policy, num_workers=num_workers, replicas_per_worker=replicas_per_worker,
                     per_replica_batch_size=per_replica_batch_size, global_batch_size=global_batch,
                     steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=total_steps,
                     assignments=assignments, imbalance_ratio=1.0)


@pytest.fixture
def tiny_manifest(tmp_path) -> Manifest:
    """256 train and 64 eval classification rows in one shard each."""
    return write_dataset(str(tmp_path / "data"))


@pytest.fixture(scope="session")
def shared_manifest(tmp_path_factory) -> Manifest:
    """Like tiny_manifest but written once per session (read-only use)."""
    return write_dataset(str(tmp_path_factory.mktemp("shared_data")), num_train=512, num_eval=128)


# --- how the suite is scheduled -----------------------------------------------------------------------------------

# `make test` runs the suite in two pytest-xdist processes with `--dist loadgroup`. A session fixture is made once
# per process, so the tests sharing an expensive one go to the same process: the fixture names the group.
XDIST_GROUP_OF_FIXTURE = {
    "ray_cluster": "ray",  # one Ray cluster on 127.0.0.2 (tests/ray/conftest.py)
    "retrain_scenario": "retrain",  # the retrain deployment's first run (tests/flows/conftest.py)
    "digits_run": "digits_run",  # the shared blessed digits run (tests/flows/conftest.py)
    "sliced_run": "sliced_run",  # the regions run of tests/flows/test_evaluation_record.py
    "tune_study": "tune_study",  # the 10-trial study of tests/flows/test_tune_flow.py
}
# TFDAG_TEST_ORDER=reverse, or random:SEED, runs the tests in another order: the suite must pass in any order (no
# test may depend on what an earlier one left in a shared fixture). Every xdist process collects the same order.
ORDER_ENV = "TFDAG_TEST_ORDER"


# Tests under these folders share one group whatever their fixtures: tests/ray's own clusters (`tfdag stack up --ray`)
# and the session cluster must not run at the same time on this machine's two cores; tests/serving's registered
# models, clean virtualenv and scoring server (tests/serving/conftest.py) are made once.
XDIST_GROUP_OF_FOLDER = {"ray": "ray", "serving": "serving"}
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _xdist_groups(item) -> set[str]:
    groups = {XDIST_GROUP_OF_FIXTURE[name] for name in getattr(item, "fixturenames", ()) if name in XDIST_GROUP_OF_FIXTURE}
    folder = os.path.relpath(str(item.path), _TESTS_DIR).split(os.sep)[0]
    if folder in XDIST_GROUP_OF_FOLDER:
        groups.add(XDIST_GROUP_OF_FOLDER[folder])
    return groups


def _uses_its_modules_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture of its own module (a training run, a trained model): the module's
    tests then go to one process as one unit, so the fixture is made once, not once in each process. (A conftest's
    module-scoped fixture, such as tests/pipeline_lib/launch's small dataset, does not group the fault matrix.)"""
    module = item.nodeid.split("::", 1)[0]
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(defs and defs[-1].scope == "module" and defs[-1].baseid == module for defs in definitions.values())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns the xdist_group marks into the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        groups = _xdist_groups(item)
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid} uses fixtures of the xdist groups {sorted(groups)}: one test "
                                    "process cannot hold both; give the fixtures one group in XDIST_GROUP_OF_FIXTURE")
        if not groups and _uses_its_modules_fixture(item):
            groups = {os.path.relpath(str(item.path), _TESTS_DIR)}
        if groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups.pop()))
    order = os.environ.get(ORDER_ENV, "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random:"):
        random.Random(order.removeprefix("random:")).shuffle(items)
    elif order:
        raise pytest.UsageError(f"{ORDER_ENV}={order!r}: use 'reverse' or 'random:SEED'")


def pytest_runtest_setup(item):
    """In an xdist process of `--dist loadgroup`, a grouped test's id carries its group (`...@ray`): that is how the
    process tells the controller. pytest 9.2 made node ids structured and pytest-xdist 3.8's suffix silently did
    nothing (pytest-xdist#1386): every group was spread over both processes, each making the shared fixtures."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail(f"pytest-xdist's --dist loadgroup did not give {item.nodeid} its xdist_group "
                    f"{item.get_closest_marker('xdist_group').args}; install the pytest and pytest-xdist of "
                    "constraints.txt", pytrace=False)
