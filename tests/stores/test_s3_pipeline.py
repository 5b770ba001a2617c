"""The pipeline's storage on a real S3 API (moto server + s3fs): staging, publishing, restore, export, launched workers.

The checks, fingerprints and the whole pipeline run on every store: test_object_stores.py.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from pipeline_lib.checkpoints import manifests, run_storage
from pipeline_lib.config import parse_config
from pipeline_lib.core import digests
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import load_manifest
from pipeline_lib.training import staging
from tests.conftest import make_plan, write_dataset
from tests.stores.conftest import ACCESS_KEY, BUCKET, SECRET_KEY

ROOT = f"s3://{BUCKET}/out"


def _config(**overrides):
    values = {
        "name": "s3-test",
        "data": {"source": f"s3://{BUCKET}/raw/*.csv", "label": "label"},
        "output_root": ROOT,
        "model": {"params": {"hidden_units": [8]}},
        "train": {"strategy": "default", "per_replica_batch_size": 32, "checkpoint_every_steps": 3,
                  "log_every_steps": 3, "keep_checkpoints": 2, "lr_scaling": "none", "steps": 6},
        "tracking": {"artifact_location": f"s3://{BUCKET}/mlflow"},
    }
    values.update(overrides)
    return parse_config(values)


def _upload_dataset(s3, tmp_path, num_train_shards: int = 2):
    local = write_dataset(str(tmp_path / "src"), num_train=256, num_eval=64, num_train_shards=num_train_shards)
    uri = f"{ROOT}/data/test-fingerprint"
    for shard in local.shards:
        s3.fs.put_file(os.path.join(local.dataset_uri, shard.path), f"{uri.removeprefix('s3://')}/{shard.path}")
    return local.model_copy(update={"dataset_uri": uri})


# ---------------------------------------------------------------- staging, training, publishing, restore


@pytest.mark.slow
def test_training_on_s3_stages_publishes_and_resumes(s3, tmp_path, monkeypatch, caplog):
    from pipeline_lib.training import loop as training
    from pipeline_lib.training.errors import TrainingInterrupted
    from pipeline_lib.training.hooks import TrainHooks

    caplog.set_level(logging.INFO)
    manifest = _upload_dataset(s3, tmp_path)
    config = _config(storage_options={"key": ACCESS_KEY, "secret": SECRET_KEY})
    plan = make_plan(manifest, steps=6)
    run_dir = f"{ROOT}/runs/r1"
    seen_during_run = {}

    class Hooks(TrainHooks):
        def on_step_end(self, step, examples, loss):
            if step == 4:  # after the step-3 log and checkpoint, before the run ends
                seen_during_run["keys"] = s3.keys("out/runs/r1")

        def stop_requested(self):
            return False

    class StopAt3(Hooks):
        def __init__(self):
            self.step = 0

        def on_step_end(self, step, examples, loss):
            self.step = step

        def stop_requested(self):
            return self.step >= 3

    # First attempt: preempted after step 3, on a "pod" with its own cache.
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "pod-a"))
    with pytest.raises(TrainingInterrupted):
        training.train(config, manifest, plan, run_dir, hooks=StopAt3())
    assert "out/runs/r1/checkpoints/ckpt-3.manifest.json" in s3.keys("out/runs/r1")
    staged_dir = staging.dataset_cache_dir(manifest, str(tmp_path / "pod-a"))
    for shard in manifest.shards:  # one worker, DATA: every train shard, and eval for the chief
        assert os.path.isfile(os.path.join(staged_dir, shard.path))

    # Second attempt: a fresh pod (empty cache) resumes from the published checkpoint.
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "pod-b"))
    result = training.train(config, manifest, plan, run_dir, hooks=Hooks())
    assert result.start_step == 3 and result.final_step == 6
    assert result.run_dir == run_dir and result.checkpoint_dir == f"{run_dir}/checkpoints"
    assert result.tensorboard_dir == f"{run_dir}/tensorboard"
    assert [r.path for r in result.checkpoints] == [f"{run_dir}/checkpoints/ckpt-3", f"{run_dir}/checkpoints/ckpt-6"]

    keys = s3.keys("out/runs/r1")
    for step in (3, 6):
        for suffix in (".index", ".data-00000-of-00001", ".manifest.json"):
            assert f"out/runs/r1/checkpoints/ckpt-{step}{suffix}" in keys
    assert any(k.startswith("out/runs/r1/tensorboard/") and "events" in k for k in keys)
    # TensorBoard logs were remote while the run went on (synced at the step-3 log and checkpoint).
    assert any("tensorboard/" in k and "events" in k for k in seen_during_run["keys"])
    manifest_6 = json.loads(s3.fs.cat_file(f"{BUCKET}/out/runs/r1/checkpoints/ckpt-6.manifest.json"))
    assert manifest_6["step"] == 6 and "eval_accuracy" in manifest_6["metrics"]

    # A third run restores step 6 and has nothing left to do.
    monkeypatch.setenv("TFDAG_CACHE_DIR", str(tmp_path / "pod-c"))
    again = training.train(config, manifest, plan, run_dir)
    assert again.start_step == again.final_step == 6

    # Consolidation of the remote run: the chosen checkpoint is downloaded verified, the export goes to S3.
    from pipeline_lib.evaluation import consolidation
    from pipeline_lib.evaluation import metrics as evaluation

    local_records = tuple(run_storage.localize_checkpoint(r, config.storage_options) for r in result.checkpoints)
    assert all(manifests.verify(r.path) is None for r in local_records)
    export = consolidation.consolidate(config, manifest, result.model_copy(update={"checkpoints": local_records}),
                                       f"{run_dir}/export")
    assert consolidation.verify_export(f"{run_dir}/export", config.storage_options) == []
    export_keys = s3.keys("out/runs/r1/export")
    assert "out/runs/r1/export/model.keras" in export_keys
    assert "out/runs/r1/export/export_manifest.json" in export_keys
    model = evaluation.load_model(export.keras_path, config.storage_options)
    report = evaluation.evaluate_model(model, staging.stage_split(manifest, "eval"), config.model.task)
    assert report.num_examples == manifest.num_records("eval")

    # No secret anywhere: not in the logs, not in any object the run wrote.
    assert SECRET_KEY not in caplog.text
    for key in s3.keys("out/runs"):
        if key.endswith((".json", ".md", ".txt")):
            assert SECRET_KEY not in s3.fs.cat_file(f"{BUCKET}/{key}").decode(errors="replace"), key


@pytest.mark.slow
def test_file_policy_workers_stage_only_their_shards_from_s3(s3, tmp_path):
    from pipeline_lib.cluster.info import ClusterInfo
    from pipeline_lib.planning.sharding import AutoShardPolicy

    manifest = _upload_dataset(s3, tmp_path, num_train_shards=4)
    plan = make_plan(manifest, num_workers=2, per_replica_batch_size=16, policy=AutoShardPolicy.FILE)
    cluster = {"worker": ("127.0.0.1:1", "127.0.0.1:2")}
    for index in (0, 1):
        cache = str(tmp_path / f"worker-{index}")
        staged = staging.stage_for_worker(manifest, plan, ClusterInfo(task_type="worker", task_index=index,
                                                                      cluster=cluster), cache_dir=cache)
        present = {os.path.relpath(os.path.join(r, f), staged.dataset_uri).replace(os.sep, "/")
                   for r, _d, files in os.walk(staged.dataset_uri) for f in files if not f.endswith(".lock")}
        expected = set(plan.files_for(index)) | ({s.path for s in manifest.shards_for("eval")} if index == 0 else set())
        assert present == expected


# ---------------------------------------------------------------- the whole pipeline


@pytest.mark.slow
def test_conversion_writes_shards_and_manifest_to_s3(s3, tmp_path):
    lines = ["f1,f2,label"] + [f"{i % 7},{(i * 3) % 5},{i % 2}" for i in range(400)]
    s3.fs.pipe_file(f"{BUCKET}/raw/rows.csv", ("\n".join(lines) + "\n").encode())
    config = _config(data={"source": f"s3://{BUCKET}/raw/*.csv", "label": "label", "target_shard_mb": 0.002})
    manifest = convert(config.data, config.output_root, config.storage_options)
    assert manifest.dataset_uri.startswith(f"{ROOT}/data/")
    assert load_manifest(manifest.dataset_uri) == manifest
    prefix = manifest.dataset_uri.removeprefix(f"s3://{BUCKET}/")
    keys = set(s3.keys(prefix))
    for shard in manifest.shards:
        key = f"{prefix}/{shard.path}"
        assert key in keys
        assert digests.file_digest(s3.fs, f"{BUCKET}/{key}", manifest.shard_digest) == shard.digest
    assert manifest.num_records("train") + manifest.num_records("eval") == 400


@pytest.mark.slow
def test_two_launched_workers_train_from_and_publish_to_s3(s3, tmp_path):
    """Real worker processes: each stages only its FILE-policy shards; the chief alone publishes."""
    from pipeline_lib.launch import local as launcher
    from pipeline_lib.launch.spec import WorkerSpec
    from pipeline_lib.planning.sharding import AutoShardPolicy

    manifest = _upload_dataset(s3, tmp_path, num_train_shards=4)
    s3.fs.pipe_file(f"{manifest.dataset_uri.removeprefix('s3://')}/manifest.json", manifest.to_json().encode())
    config = _config(train={"strategy": "multi_worker_mirrored", "workers": 2, "per_replica_batch_size": 16,
                            "checkpoint_every_steps": 2, "log_every_steps": 2, "steps": 4, "lr_scaling": "none",
                            "hang_timeout_s": 120, "max_restarts": 0},
                     preflight={"enabled": False})
    plan = make_plan(manifest, num_workers=2, per_replica_batch_size=16, steps=4, policy=AutoShardPolicy.FILE)
    run_dir = f"{ROOT}/runs/launched"
    spec = WorkerSpec(config=config.model_dump(mode="json"), dataset_uri=manifest.dataset_uri, plan=plan,
                      run_dir=run_dir, heartbeat_dir=str(tmp_path / "heartbeats"))
    lines = []
    outcome = launcher.launch(spec, config, log_fn=lines.append, timeout_s=400)
    result = outcome.result
    assert result.final_step == 4 and result.num_workers == 2
    assert [r.path for r in result.checkpoints] == [f"{run_dir}/checkpoints/ckpt-2", f"{run_dir}/checkpoints/ckpt-4"]
    keys = s3.keys("out/runs/launched")
    assert "out/runs/launched/result.json" in keys
    assert "out/runs/launched/checkpoints/ckpt-4.manifest.json" in keys
    assert not any(".scratch" in k for k in keys), "only the chief's checkpoint is published"
    # Each worker staged its own train shards (and the chief the eval split) into the shared host cache.
    staged = staging.dataset_cache_dir(manifest)
    present = {os.path.relpath(os.path.join(r, f), staged).replace(os.sep, "/")
               for r, _d, files in os.walk(staged) for f in files if not f.endswith(".lock")}
    assert present == {s.path for s in manifest.shards}
    text = "\n".join(lines)
    # The chief: its 2 train shards and the eval shard; worker 1: its 2 train shards only.
    assert any(line.startswith("[worker 0]") and "staged 3 shard(s)" in line for line in lines), text[-3000:]
    assert any(line.startswith("[worker 1]") and "staged 2 shard(s)" in line for line in lines), text[-3000:]
    assert SECRET_KEY not in text
