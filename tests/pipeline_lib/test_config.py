"""Config loading: frozen models, unknown keys rejected, errors naming key path, file, value and fix."""

import json

import pydantic
import pytest
import yaml

from pipeline_lib.checkpoints import selection
from pipeline_lib.config import (
    ConfigError,
    Direction,
    LrScaling,
    PipelineConfig,
    Strategy,
    load_config,
    resolve_config,
)
from pipeline_lib.core.secrets import MASK

MINIMAL = {"data": {"source": "./raw/*.csv", "label": "y"}}


def write(tmp_path, data, name="pipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_minimal_config_gets_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.train.strategy is Strategy.AUTO
    assert config.train.lr_scaling is LrScaling.LINEAR
    assert config.output_root == "./.tfdag"
    assert config.mlflow_uri.startswith("sqlite:///") and config.mlflow_uri.endswith(".tfdag/mlflow.db")


def test_config_is_frozen(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.train.epochs = 3  # type: ignore[misc]


def test_bad_value_names_key_path_file_value_and_rule(tmp_path):
    data = {**MINIMAL, "train": {"per_replica_batch_size": 0}}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data, "digits.yaml"))
    message = str(err.value)
    assert "train.per_replica_batch_size (0) in digits.yaml" in message
    assert "greater than or equal to 1" in message


def test_unknown_key_is_rejected_with_allowed_keys(tmp_path):
    data = {**MINIMAL, "train": {"epochz": 3}}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data))
    message = str(err.value)
    assert "train.epochz in pipe.yaml is not a known key" in message
    assert "epochs" in message and "per_replica_batch_size" in message


def test_unknown_top_level_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer in pipe.yaml is not a known key; allowed keys here: .*train"):
        load_config(write(tmp_path, {**MINIMAL, "trainer": {}}))


def test_bad_enum_lists_allowed_values(tmp_path):
    data = {**MINIMAL, "train": {"strategy": "horovod"}}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data))
    message = str(err.value)
    assert "train.strategy ('horovod') in pipe.yaml" in message
    assert "'multi_worker_mirrored'" in message and "'parameter_server'" in message


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.label in pipe.yaml is required but missing"):
        load_config(write(tmp_path, {"data": {"source": "x.csv"}}))


def test_bad_model_factory_names_the_form(tmp_path):
    data = {**MINIMAL, "model": {"factory": "mypkg.models"}}
    with pytest.raises(ConfigError, match=r"model.factory \('mypkg.models'\).*'package.module:function'"):
        load_config(write(tmp_path, data))


def test_invalid_combination_fails_at_construction(tmp_path):
    data = {**MINIMAL, "train": {"strategy": "mirrored", "parameter_servers": 1}}
    with pytest.raises(ConfigError, match=r"parameter_servers \(1\) needs strategy 'parameter_server'"):
        load_config(write(tmp_path, data))


def test_elastic_is_off_by_default_and_parses(tmp_path):
    assert load_config(write(tmp_path, MINIMAL)).train.elastic is None
    elastic = load_config(write(tmp_path, {**MINIMAL, "train": {"workers": 3, "elastic": {"min_workers": 2}}})).train.elastic
    assert (elastic.min_workers, elastic.wait_s) == (2, 60.0)
    # Parameter-server training resizes its workers (its servers are kept): auto with servers, or the strategy named.
    for train in ({"workers": 3, "parameter_servers": 1}, {"workers": 3, "parameter_servers": 2,
                                                           "strategy": "parameter_server"}):
        ps = load_config(write(tmp_path, {**MINIMAL, "train": {**train, "elastic": {"min_workers": 2}}})).train
        assert ps.uses_parameter_server() and ps.elastic.min_workers == 2


@pytest.mark.parametrize(("train", "message"), [
    ({"workers": 1, "elastic": {"min_workers": 1}},
     r"train.elastic.min_workers \(1\) with train.workers 1: one worker has nothing to shrink to; raise train.workers"),
    ({"workers": 3, "elastic": {"min_workers": 4}},
     r"train.elastic.min_workers \(4\) is more than train.workers \(3\).*between 1 and 3"),
    ({"workers": 3, "elastic": {"min_workers": 0}}, r"train.elastic.min_workers \(0\).*greater than or equal to 1"),
    ({"workers": 3, "strategy": "mirrored", "elastic": {"min_workers": 2}},
     r"train.elastic.min_workers \(2\) with train.strategy 'mirrored', a one-worker strategy"),
    ({"workers": 3, "autoshard": "file", "elastic": {"min_workers": 2}},
     r"train.elastic.min_workers \(2\) with train.autoshard 'file'.*set train.autoshard: auto or data"),
])
def test_elastic_refuses_what_cannot_resize(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, {**MINIMAL, "train": train}))


def test_unknown_metric(tmp_path):
    data = {**MINIMAL, "evaluation": {"metrics": ["accuracy", "f7"]}}
    with pytest.raises(ConfigError, match=r"evaluation.metrics .*unknown metric\(s\) \['f7'\]"):
        load_config(write(tmp_path, data))


REGRESSION = {**MINIMAL, "model": {"task": "regression"}}


def test_evaluation_defaults_follow_the_task():
    classification = PipelineConfig.model_validate(MINIMAL)
    assert classification.evaluation.metrics == ("loss", "accuracy", "auc")
    assert classification.evaluation.gate.metric == "accuracy"
    assert selection.selection_metric(classification) == ("eval_accuracy", Direction.MAX)
    regression = PipelineConfig.model_validate(REGRESSION)
    assert regression.evaluation.metrics == ("loss", "mae", "rmse", "r2")
    assert regression.evaluation.gate.metric == "rmse"
    assert selection.selection_metric(regression) == ("eval_rmse", Direction.MIN)
    assert regression.evaluation.gate.beat_baseline and regression.evaluation.gate.baseline_margin == 0.0
    # What was derived stays "left out": model_fields_set tells it from the user's choice.
    assert "metrics" not in regression.evaluation.model_fields_set
    assert "metric" not in regression.evaluation.gate.model_fields_set


def test_an_explicit_choice_wins_over_the_tasks_defaults():
    config = PipelineConfig.model_validate({**REGRESSION, "evaluation": {"metrics": ["loss", "mae"],
                                                                         "gate": {"metric": "mae"}}})
    assert config.evaluation.metrics == ("loss", "mae") and config.evaluation.gate.metric == "mae"
    assert {"metrics"} <= config.evaluation.model_fields_set and "metric" in config.evaluation.gate.model_fields_set
    # An explicit null is the default: derived from the task.
    nulls = PipelineConfig.model_validate({**REGRESSION, "evaluation": {"metrics": None, "gate": {"metric": None}}})
    assert nulls.evaluation == PipelineConfig.model_validate(REGRESSION).evaluation


@pytest.mark.parametrize("task,evaluation,message", [
    ("regression", {"gate": {"metric": "accuracy"}},
     (r"evaluation.gate.metric \('accuracy'\) is not a metric model.task regression computes; choose one of "
     r"\['loss', 'mae', 'rmse', 'r2'\] \(or leave it out: 'rmse'\) \(in pipe.yaml\)")),
    ("regression", {"gate": {"metric": "auc"}}, r"evaluation.gate.metric \('auc'\) is not a metric model.task regression"),
    ("classification", {"gate": {"metric": "rmse"}},
     (r"evaluation.gate.metric \('rmse'\) is not a metric model.task classification computes; choose one of "
     r"\['loss', 'accuracy', 'auc'\]")),
    ("classification", {"gate": {"metric": "confusion_matrix"}}, r"'confusion_matrix'\) is not a metric"),
    ("regression", {"metrics": ["loss", "mae"]},
     (r"evaluation.gate.metric \('rmse'\) is not among evaluation.metrics \['loss', 'mae'\], so the run would not "
     r"compute it; add it there, or gate on one of those")),
    ("regression", {"metrics": ["loss", "accuracy", "auc"]},
     (r"evaluation.metrics \['accuracy', 'auc'\] do not fit model.task regression; it computes "
     r"\['loss', 'mae', 'rmse', 'r2'\]")),
])
def test_a_metric_that_does_not_fit_the_task_is_a_config_error(tmp_path, task, evaluation, message):
    data = {**MINIMAL, "model": {"task": task}, "evaluation": evaluation}
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, data))


def test_derived_defaults_round_trip_through_every_dump_and_follow_a_task_override():
    from pipeline_lib.config.overrides import apply_overrides

    regression = PipelineConfig.model_validate(REGRESSION)
    dumped = yaml.safe_load(regression.masked_yaml())
    assert dumped["evaluation"]["metrics"] is None and dumped["evaluation"]["gate"]["metric"] is None
    for values in (dumped, regression.model_dump(mode="json"), regression.for_process()[0],
                   json.loads(regression.model_dump_json())):
        again = PipelineConfig.model_validate(values)
        assert again == regression and again.config_hash() == regression.config_hash()
    # A dump that travels (a Prefect parameter, a retrain override) derives the defaults anew for its task.
    classification = apply_overrides(regression, {"model.task": "classification"})
    assert classification.evaluation.metrics == ("loss", "accuracy", "auc")
    assert classification.evaluation.gate.metric == "accuracy"
    # An explicit choice is dumped as written, and stays.
    explicit = PipelineConfig.model_validate({**REGRESSION, "evaluation": {"gate": {"metric": "mae"}}})
    assert yaml.safe_load(explicit.masked_yaml())["evaluation"]["gate"]["metric"] == "mae"
    # The metrics chosen, the gate's metric derived: the choice is dumped as written all the same.
    chosen = PipelineConfig.model_validate({**REGRESSION, "evaluation": {"metrics": ["loss", "mae", "rmse"]}})
    assert yaml.safe_load(chosen.masked_yaml())["evaluation"]["metrics"] == ["loss", "mae", "rmse"]
    assert PipelineConfig.model_validate(chosen.model_dump(mode="json")).evaluation.metrics == ("loss", "mae", "rmse")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)


def test_resolve_accepts_object_mapping_path_and_inline_yaml(tmp_path):
    path = write(tmp_path, MINIMAL)
    from_path = resolve_config(str(path))
    assert resolve_config(from_path) is from_path
    assert resolve_config(MINIMAL) == from_path
    assert resolve_config(yaml.safe_dump(MINIMAL)) == from_path


def test_config_hash_is_stable_and_sensitive():
    a = PipelineConfig.model_validate(MINIMAL)
    b = PipelineConfig.model_validate(MINIMAL)
    c = PipelineConfig.model_validate({**MINIMAL, "train": {"epochs": 9}})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_example_configs_load():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml")):
        load_config(path)


def test_masked_yaml_hides_secret_keys_and_url_passwords_but_keeps_the_rest():
    from pipeline_lib.config import parse_config

    config = parse_config({
        "name": "masked",
        "data": {"source": "s3://bucket/raw.csv", "label": "y",
                 "storage_options": {"key": "AKIAEXAMPLE", "secret": "sekrit-value", "client_kwargs": {
                     "endpoint_url": "http://127.0.0.1:9000"}}},
        "tracking": {"mlflow_uri": "http://alice:pa55word@127.0.0.1:5000"},
    })
    text = config.masked_yaml()
    assert "AKIAEXAMPLE" not in text and "sekrit-value" not in text and "pa55word" not in text
    loaded = yaml.safe_load(text)
    assert loaded["data"]["storage_options"]["secret"] == MASK
    assert loaded["data"]["storage_options"]["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    assert loaded["tracking"]["mlflow_uri"] == f"http://alice:{MASK}@127.0.0.1:5000"
    assert loaded["name"] == "masked" and loaded["data"]["label"] == "y"


def test_train_launcher_ray_section_defaults_and_rules():
    from pipeline_lib.config import Launcher, RayPlacement, parse_config

    base = {"data": {"source": "x.csv", "label": "y"}}
    config = parse_config(base)
    assert config.train.launcher == Launcher.LOCAL
    assert config.train.ray.placement == RayPlacement.SPREAD and config.train.ray.resources_per_worker == {"CPU": 1.0}
    ray = parse_config({**base, "train": {"launcher": "ray", "ray": {
        "address": "127.0.0.2:6379", "resources_per_worker": {"CPU": 1, "memory": 2**30, "node_a": 1},
        "placement": "pack", "runtime_env": {"env_vars": {"A": "1"}}}}}).train.ray
    assert ray.resolved_address({}) == "127.0.0.2:6379" and ray.placement == RayPlacement.PACK
    assert ray.runtime_env == {"env_vars": {"A": "1"}}
    with pytest.raises(ConfigError, match=r"train\.launcher.*'local', 'ray'|launcher"):
        parse_config({**base, "train": {"launcher": "k8s"}}, source="digits.yaml")
    with pytest.raises(ConfigError, match="must be ≥ 0"):
        parse_config({**base, "train": {"ray": {"resources_per_worker": {"CPU": -1}}}})


def test_ray_address_comes_from_the_config_then_ray_address_and_neither_names_both():
    from pipeline_lib.config import RayConfig

    assert RayConfig().resolved_address({"RAY_ADDRESS": "10.0.0.5:6379"}) == "10.0.0.5:6379"
    assert RayConfig(address="head:6379").resolved_address({"RAY_ADDRESS": "other:1"}) == "head:6379"
    with pytest.raises(ConfigError) as error:
        RayConfig().resolved_address({})
    assert "neither train.ray.address nor the RAY_ADDRESS environment variable is set" in str(error.value)


def test_every_dump_of_a_config_masks_its_secrets_and_for_process_moves_them_to_the_environment(monkeypatch):
    from fastapi.encoders import jsonable_encoder

    from pipeline_lib.config import parse_config
    from pipeline_lib.core import storage

    config = parse_config({
        "name": "secrets",
        "data": {"source": "s3://bucket/raw.csv", "label": "y", "split": {"key_columns": ["id"]},
                 "storage_options": {"key": "AKIAEXAMPLE", "secret": "sekrit-value"}},
        "storage_options": {"secret": "${MY_S3_SECRET}", "connection_string": "AccountKey=azure-key;"},
        "tracking": {"mlflow_uri": "http://alice:pa55word@127.0.0.1:5000"},
        "train": {"ray": {"runtime_env": {"env_vars": {"API_TOKEN": "ray-token"}}}},
    })
    # The Prefect parameter (FastAPI's encoder), JSON, a Python dump and the config's hash hold no secret.
    for dumped in (json.dumps(jsonable_encoder(config)), config.model_dump_json(), str(config.model_dump()),
                   config.masked_yaml(), repr(config), str(config)):
        for secret in ("AKIAEXAMPLE", "sekrit-value", "azure-key", "pa55word", "ray-token"):
            assert secret not in dumped
        assert "${MY_S3_SECRET}" in dumped and MASK in dumped and "id" in dumped
    # In this process the values are as written.
    assert config.data.storage_options["secret"] == "sekrit-value"
    assert config.mlflow_uri == "http://alice:pa55word@127.0.0.1:5000"
    assert config.mlflow_uri_shown == f"http://alice:{MASK}@127.0.0.1:5000"
    # Another process gets references, and the values in its environment.
    values, env = config.for_process()
    assert "sekrit-value" not in json.dumps(values) and "pa55word" not in json.dumps(values)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MY_S3_SECRET", "from-env")
    worker = parse_config(values)
    assert storage.expand_env(worker.data.storage_options) == {"key": "AKIAEXAMPLE", "secret": "sekrit-value"}
    assert storage.expand_env(worker.storage_options)["secret"] == "from-env"
    assert worker.mlflow_uri == "http://alice:pa55word@127.0.0.1:5000"


def test_a_masked_secret_that_reaches_storage_names_the_option_and_the_fix():
    from pipeline_lib.config import parse_config
    from pipeline_lib.core import storage

    stored = parse_config(parse_config({"data": {"source": "s3://b/r.csv", "label": "y",
                                                 "storage_options": {"secret": "x"}}}).model_dump(mode="json"))
    with pytest.raises(storage.StorageAccessError, match=r"data.storage_options.secret holds .*\$\{VARIABLE\}"):
        storage.expand_env(stored.data.storage_options, "data.storage_options")
