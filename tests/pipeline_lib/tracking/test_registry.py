"""Champion/challenger logic: source fingerprints, the promotion rule, aliases and tags on a real MLflow registry."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline_lib.config import (
    ConfigError,
    DataConfig,
    Direction,
    GateConfig,
    ModelConfig,
    RegisterPolicy,
    parse_config,
)
from pipeline_lib.config.overrides import apply_overrides
from pipeline_lib.data.manifest import SourceFile, SourceFingerprint
from pipeline_lib.data.sources import source_fingerprint
from pipeline_lib.evaluation.gate import decide
from pipeline_lib.tracking import registration, registry
from pipeline_lib.tracking.registration import check_for_new_data
from pipeline_lib.tracking.run import BLESSED_RUN_TAG
from pipeline_lib.training.warm_start import write_warm_start_checkpoint

# --- the source fingerprint the retrain flow compares ---------------------------------------------------------

def _data(source: str) -> DataConfig:
    return DataConfig(source=source, format="csv", label="b")


def test_source_fingerprint_is_stable_and_changes_when_rows_are_appended(tmp_path):
    """What the retrain flow compares: conversion's listing fingerprint, before any conversion runs."""
    source = tmp_path / "raw.csv"
    source.write_text("a,b\n1,2\n")
    first = source_fingerprint(_data(str(source)))
    assert first == source_fingerprint(_data(str(source)))
    with open(source, "a") as handle:
        handle.write("3,4\n")
    assert source_fingerprint(_data(str(source))).sha256 != first.sha256


def test_source_fingerprint_of_a_glob_sees_a_new_file(tmp_path):
    for name in ("part-1.csv", "part-2.csv"):
        (tmp_path / name).write_text("a,b\n1,2\n")
    glob = str(tmp_path / "part-*.csv")
    before = source_fingerprint(_data(glob))
    (tmp_path / "part-3.csv").write_text("a,b\n5,6\n")
    after = source_fingerprint(_data(glob))
    assert (len(before.files), len(after.files)) == (2, 3) and after.sha256 != before.sha256


# --- the registration policy (the promotion rule itself is evaluation.gate.decide, tested there) ------------

MAX_ACC = GateConfig(metric="accuracy", direction=Direction.MAX)


def test_only_a_blessed_model_is_registered_unless_register_is_always():
    why = registration.why_not_registered
    blessed, refused = decide(0.9, MAX_ACC), decide(0.1, MAX_ACC, champion_value=0.9, champion_version=1)
    assert why(RegisterPolicy.BLESSED, blessed) is None and why(RegisterPolicy.ALWAYS, blessed) is None
    assert why(RegisterPolicy.BLESSED, refused) == "not blessed"
    assert why(RegisterPolicy.ALWAYS, refused) is None


def test_a_model_that_failed_the_model_check_is_never_registered():
    from tests.pipeline_lib.evaluation.test_gate import _model_check

    why = registration.why_not_registered
    blessed = decide(0.9, MAX_ACC)
    assert why(RegisterPolicy.BLESSED, blessed, _model_check(True)) is None
    assert why(RegisterPolicy.BLESSED, blessed, _model_check(False)) == "the model check failed"
    assert why(RegisterPolicy.ALWAYS, blessed, _model_check(False)) == "the model check failed"


# --- config overrides -----------------------------------------------------------------------------------------

def _config(**tracking):
    return parse_config({"name": "t", "data": {"source": "x.csv", "label": "y"},
                         "tracking": {"registered_model": "m", **tracking}})


def test_overrides_replace_dotted_keys_and_validate():
    config = apply_overrides(_config(), {"train.steps": 1, "evaluation.gate.threshold": None,
                                                  "model.params.hidden_units": [4]})
    assert config.train.steps == 1 and config.evaluation.gate.threshold is None
    assert config.model.params == {"hidden_units": [4]}


def test_overrides_name_a_bad_key_and_value():
    with pytest.raises(ConfigError, match=r"train.stepz in overrides is not a known key"):
        apply_overrides(_config(), {"train.stepz": 1})
    with pytest.raises(ConfigError, match=r"train.steps \(0\) in overrides"):
        apply_overrides(_config(), {"train.steps": 0})
    with pytest.raises(ConfigError, match=r"name is not a config section"):
        apply_overrides(_config(), {"name.x": 0})


# --- the MLflow registry (a real sqlite store) ----------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("registry-test", artifact_location=str(tmp_path / "artifacts"))
    client.create_registered_model("m")

    def new_version(fingerprint: str | None = None, config_hash: str = "h") -> str:
        run = client.create_run(experiment)
        mv = client.create_model_version("m", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
        if fingerprint:
            client.set_model_version_tag("m", mv.version, registry.FINGERPRINT_TAG, fingerprint)
        return mv.version

    return uri, client, new_version


def _fingerprint(sha: str) -> SourceFingerprint:
    return SourceFingerprint(files=(SourceFile(path="s", size=1, mtime="1"),), sha256=sha)


def test_no_champion_until_an_alias_is_set(store):
    uri, _client, new_version = store
    assert registry.get_champion(uri, "m") is None
    assert registry.get_champion(uri, "model-that-does-not-exist") is None
    assert registry.latest_version(uri, "m") is None
    new_version()
    assert registry.get_champion(uri, "m") is None
    assert registry.latest_version(uri, "m").version == 1


def test_record_decision_tags_both_scores_and_moves_the_alias_only_when_blessed(store):
    uri, client, new_version = store
    v1 = new_version()
    first = decide(0.8, MAX_ACC)
    info = registry.record_decision(uri, "m", v1, first, fingerprint=_fingerprint("a" * 64), config_hash="h")
    assert info.blessed is True and info.source_fingerprint == "a" * 64
    assert registry.get_champion(uri, "m").version == 1

    v2 = new_version()
    worse = decide(0.7, MAX_ACC, champion_value=0.8, champion_version=1)
    info = registry.record_decision(uri, "m", v2, worse, fingerprint=_fingerprint("b" * 64), config_hash="h")
    assert info.blessed is False
    assert float(info.tags[registry.CHALLENGER_SCORE_TAG]) == 0.7
    assert float(info.tags[registry.CHAMPION_SCORE_TAG]) == 0.8
    assert info.tags[registry.COMPARED_WITH_TAG] == "1"
    assert str(client.get_model_version_by_alias("m", "champion").version) == "1"

    v3 = new_version()
    better = decide(0.9, MAX_ACC, champion_value=0.8, champion_version=1)
    registry.record_decision(uri, "m", v3, better, alias=None)  # the training pipeline tags, never promotes
    assert registry.get_champion(uri, "m").version == 1
    registry.record_decision(uri, "m", v3, better)
    champion = registry.get_champion(uri, "m")
    assert champion.version == 3 and "champion" in champion.aliases


def test_check_for_new_data_skips_the_champions_data_and_a_refused_retry(store):
    uri, _client, new_version = store
    fp_a, fp_b = _fingerprint("a" * 64), _fingerprint("b" * 64)
    check = check_for_new_data(fp_a, "h", None, None)
    assert check.train and "no champion yet" in check.message

    registry.record_decision(uri, "m", new_version(), decide(0.8, MAX_ACC),
                             fingerprint=fp_a, config_hash="h")
    champion = registry.get_champion(uri, "m")
    check = check_for_new_data(fp_a, "h", champion, registry.latest_version(uri, "m"))
    assert not check.train and check.message.startswith("no new data since version 1")

    registry.record_decision(uri, "m", new_version(), decide(0.1, MAX_ACC, champion_value=0.8, champion_version=1),
                             fingerprint=fp_b, config_hash="h")
    latest = registry.latest_version(uri, "m")
    check = check_for_new_data(fp_b, "h", champion, latest)
    assert not check.train and check.version == 2 and "not promoted" in check.message
    assert check_for_new_data(fp_b, "other-config", champion, latest).train
    assert check_for_new_data(_fingerprint("c" * 64), "h", champion, latest).train


def test_a_refused_run_that_registered_nothing_is_not_retrained_on_the_same_data(store):
    """With tracking.register: blessed a refused challenger leaves only its MLflow run, tagged tfdag.blessed=false."""
    uri, client, _new_version = store
    fp = _fingerprint("d" * 64)
    experiment = client.get_experiment_by_name("registry-test").experiment_id
    assert registry.last_refused_run(uri, "registry-test", fp, "h") is None
    assert registry.last_refused_run(uri, "no-such-experiment", fp, "h") is None
    run = client.create_run(experiment, tags={BLESSED_RUN_TAG: "false", registry.FINGERPRINT_TAG: fp.sha256,
                                              registry.CONFIG_HASH_TAG: "h"})
    client.create_run(experiment, tags={BLESSED_RUN_TAG: "true", registry.FINGERPRINT_TAG: "e" * 64,
                                        registry.CONFIG_HASH_TAG: "h"})
    refused = registry.last_refused_run(uri, "registry-test", fp, "h")
    assert refused == run.info.run_id
    assert registry.last_refused_run(uri, "registry-test", fp, "other-config") is None
    check = check_for_new_data(fp, "h", None, None, refused)
    assert not check.train and run.info.run_id in check.message and "not blessed" in check.message


# --- warm start -----------------------------------------------------------------------------------------------

def test_warm_start_checkpoint_restores_into_a_freshly_built_model(tmp_path, shared_manifest):
    """The champion's .keras weights, written as the checkpoint `train.warm_start_uri` reads, fill a new model."""
    import keras
    import tensorflow as tf

    from pipeline_lib.training import models

    model_config = ModelConfig(factory="mlp", params={"hidden_units": [8]})
    keras.utils.set_random_seed(1)
    champion = models.create_model(model_config, shared_manifest.feature_schema)
    keras_path = str(tmp_path / "champion.keras")
    champion.save(keras_path)

    prefix = write_warm_start_checkpoint(keras_path, str(tmp_path / "warm"))
    keras.utils.set_random_seed(2)
    fresh = models.create_model(model_config, shared_manifest.feature_schema)
    assert not all(np.allclose(a, b) for a, b in zip(champion.get_weights(), fresh.get_weights()))
    # What pipeline_lib.training.loop does with train.warm_start_uri.
    tf.train.Checkpoint(model=fresh).read(prefix).assert_existing_objects_matched()
    for expected, actual in zip(champion.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(actual, expected)


@pytest.mark.slow
def test_download_keras_model_returns_the_registered_weights(tmp_path, shared_manifest, monkeypatch):
    """What the retrain flow evaluates as the champion: the registered version's own .keras file."""
    import keras
    from mlflow import MlflowClient

    from pipeline_lib.config import Task
    from pipeline_lib.serving import signatures
    from pipeline_lib.tracking import model_logging
    from pipeline_lib.training import models

    monkeypatch.chdir(tmp_path)  # MLflow may default artifacts to ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("download-test", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment)
    model = models.create_model(ModelConfig(factory="mlp", params={"hidden_units": [4]}),
                                shared_manifest.feature_schema)
    keras_path, saved_model_dir = str(tmp_path / "model.keras"), str(tmp_path / "saved_model")
    model.save(keras_path)
    signatures.export_saved_model(model, shared_manifest.feature_schema, Task.CLASSIFICATION, saved_model_dir)
    version = model_logging.log_and_register_model(run.info.run_id, uri, saved_model_dir, keras_path, "dl",
                                                   shared_manifest)

    downloaded = registry.download_keras_model(uri, "dl", version.version, str(tmp_path / "download"))
    assert downloaded.endswith(".keras")
    reloaded = keras.saving.load_model(downloaded, compile=False)
    for expected, actual in zip(model.get_weights(), reloaded.get_weights()):
        np.testing.assert_allclose(actual, expected)
