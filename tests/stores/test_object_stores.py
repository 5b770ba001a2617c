"""The same storage behaviour on every object store: S3 (moto), Google Cloud Storage (gcp-storage-emulator) and
Azure Blob Storage (Azurite), each a real server on 127.0.0.1 (see conftest.py).

Before training: every URI checked, a missing bucket or container and a wrong credential named with the URI.
The source fingerprint follows an object's content. The digits pipeline with its raw CSV, output_root and MLflow
artifacts all on the store.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.core import storage
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.sources import source_fingerprint
from tests.stores.conftest import BUCKET


def _config(store, **overrides):
    values = {
        "name": "store-test",
        "data": {"source": store.uri("raw/*.csv"), "label": "label"},
        "output_root": store.uri("out"),
        "tracking": {"artifact_location": store.uri("mlflow")},
    }
    values.update(overrides)
    return parse_config(values)


# ---------------------------------------------------------------- storage checks, before any training


def test_check_storage_passes_for_every_uri(store):
    store.fs.pipe_file(f"{BUCKET}/raw/digits.csv", b"a,label\n1,0\n")
    checked = storage.check_storage(_config(store))
    assert checked == (store.uri("raw/*.csv"), store.uri("out"), store.uri("mlflow"))
    # The write probes leave nothing behind.
    assert store.keys() == ["raw/digits.csv"]


def test_a_missing_bucket_is_named_before_training(store):
    store.fs.pipe_file(f"{BUCKET}/raw/digits.csv", b"a,label\n1,0\n")
    word = storage.object_store(store.uri()).bucket_word
    for key, config in (
        ("output_root", _config(store, output_root=f"{store.protocol}://no-such-bucket/out")),
        ("data.source", _config(store, data={"source": f"{store.protocol}://no-such-bucket/raw/*.csv",
                                             "label": "label"})),
        ("tracking.artifact_location", _config(store, tracking={
            "artifact_location": f"{store.protocol}://no-such-bucket/mlflow"})),
    ):
        with pytest.raises(storage.StorageAccessError) as caught:
            storage.check_storage(config)
        message = str(caught.value)
        uri = f"{store.protocol}://no-such-bucket/"
        assert f"the {word} 'no-such-bucket' of {key} ('{uri}" in message, message
        assert "does not exist; create it" in message, message


def test_a_source_that_matches_nothing_is_named(store):
    uri = store.uri("raw/*.csv")
    with pytest.raises(storage.StorageError, match=rf"data.source \('{uri.replace('*', '[*]')}'\) matches no file"):
        storage.check_storage(_config(store))


def test_wrong_credentials_are_named_without_the_secret(store, tmp_path, monkeypatch):
    store.fs.pipe_file(f"{BUCKET}/raw/digits.csv", b"a,label\n1,0\n")
    good, wrong, secret = store.wrong_credentials(tmp_path, monkeypatch)
    source = store.uri("raw/*.csv")
    storage.check_storage(_config(store, storage_options=good,
                                  data={"source": source, "label": "label", "storage_options": good}))
    bad = _config(store, data={"source": source, "label": "label", "storage_options": wrong})
    with pytest.raises(storage.StorageAccessError) as caught:
        storage.check_storage(bad)
    message = str(caught.value)
    assert f"data.source ('{source}') refused the credentials" in message, message
    assert "data.storage_options" in message and secret not in message
    with pytest.raises(storage.StorageAccessError) as caught:
        storage.check_storage(_config(store, storage_options=wrong,
                                      data={"source": source, "label": "label", "storage_options": good}))
    assert f"output_root ('{store.uri('out')}') refused the credentials" in str(caught.value)
    assert secret not in str(caught.value)


# ---------------------------------------------------------------- the source fingerprint


def test_the_source_fingerprint_follows_an_objects_content(store):
    config = _config(store)
    store.fs.pipe_file(f"{BUCKET}/raw/digits.csv", b"a,label\n1,0\n")
    first = source_fingerprint(config.data)
    store.fs.invalidate_cache()
    assert source_fingerprint(config.data) == first, "unchanged objects keep their fingerprint"
    # The same size, another content: only the store's version marker (ETag, generation) can tell.
    store.fs.pipe_file(f"{BUCKET}/raw/digits.csv", b"a,label\n2,0\n")
    store.fs.invalidate_cache()
    storage.get_fs(store.uri())[0].invalidate_cache()
    second = source_fingerprint(config.data)
    assert second.sha256 != first.sha256
    assert [f.size for f in second.files] == [f.size for f in first.files]
    assert second.files[0].mtime and second.files[0].mtime != first.files[0].mtime


# ---------------------------------------------------------------- the whole pipeline


EXAMPLES = {"s3": "digits_s3.yaml", "gs": "digits_gcs.yaml", "az": "digits_azure.yaml"}


@pytest.mark.slow
def test_digits_pipeline_runs_with_every_uri_on_the_store(store, tmp_path, prefect_api, caplog):
    import yaml
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from flows.pipeline import training_pipeline

    caplog.set_level(logging.INFO)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", EXAMPLES[store.protocol])
    with open(example) as handle:
        values = yaml.safe_load(handle)
    # Every URI stays as the example has it, on <store>://tfdag-demo/; the training is cut to a few steps (what is
    # tested here is the storage, not the model: the example's accuracy is the local pipeline tests' concern), with
    # two checkpoints. Where the store takes a credential, it also goes in through storage_options, to prove it
    # never reaches MLflow, Prefect or the logs.
    values["train"].update({"steps": 10, "warmup_steps": 0, "checkpoint_every_steps": 5, "log_every_steps": 5})
    values["tracking"]["mlflow_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    values["tracking"]["experiment"] = f"digits-{store.protocol}-{tmp_path.name}"
    values["storage_options"] = dict(store.options)
    values["data"]["storage_options"] = dict(store.options)
    config = parse_config(values, source=EXAMPLES[store.protocol])
    for uri in (config.data.source, config.output_root, config.tracking.artifact_location):
        assert uri.startswith(store.uri()), uri
    demo_data.write_digits_csv(config.data.source, config.data.storage_options)
    storage.check_storage(config)
    summary = training_pipeline(config)

    assert summary.final_step == 10 and 0.0 <= summary.metrics["accuracy"] <= 1.0, summary.metrics
    keys = store.keys()
    run = summary.run_dir.removeprefix(f"{store.uri()}/")
    assert run.startswith("tfdag/runs/")
    assert f"tfdag/data/{summary.data_fingerprint}/manifest.json" in keys
    assert any(k.startswith(f"tfdag/data/{summary.data_fingerprint}/train/") for k in keys)
    assert f"{run}/export/export_manifest.json" in keys and f"{run}/export/model.keras" in keys
    assert any(k.startswith(f"{run}/checkpoints/") and k.endswith(".manifest.json") for k in keys)
    assert any(k.startswith(f"{run}/tensorboard/") for k in keys)
    # MLflow's own client wrote the run's artifacts and the logged model to the store.
    client = MlflowClient(tracking_uri=config.mlflow_uri)
    mlflow_run = client.get_run(summary.mlflow_run_id)
    assert mlflow_run.info.artifact_uri.startswith(storage.mlflow_artifact_uri(store.uri("mlflow")))
    mlflow_keys = [k for k in keys if k.startswith("mlflow/")]
    assert any(k.endswith("evaluation/evaluation.json") or "/evaluation/" in k for k in mlflow_keys), mlflow_keys
    assert [a.path for a in client.list_artifacts(summary.mlflow_run_id, "evaluation")]
    # The evaluation read the checkpoint back from the store: its accuracy is the one MLflow logged.
    assert mlflow_run.data.metrics["final_eval_accuracy"] == pytest.approx(summary.metrics["accuracy"])
    # The TFRecords on the store are the run's dataset inputs, their source in MLflow's form of the URI.
    sources = [json.loads(d.dataset.source) for d in mlflow_run.inputs.dataset_inputs]
    assert sources and all(storage.mlflow_artifact_uri(store.uri("tfdag/data")) in json.dumps(s) for s in sources)

    if store.secret is None:
        return
    # No secret in MLflow params or tags, in Prefect artifacts, in the logs, or in any text object written.
    for name, value in {**mlflow_run.data.params, **mlflow_run.data.tags}.items():
        assert store.secret not in str(value), name
    with get_client(sync_client=True) as prefect:
        for artifact in prefect.read_artifacts():
            assert store.secret not in json.dumps(artifact.data, default=str), artifact.key
    assert store.secret not in caplog.text
    for key in keys:
        if key.endswith((".json", ".md", ".txt", ".yaml", ".csv")) and "raw/" not in key:
            assert store.secret not in store.fs.cat_file(f"{BUCKET}/{key}").decode(errors="replace"), key
