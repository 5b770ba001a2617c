"""`tune:` in the pipeline config (config/tune.py, config/tune_space.py): the issue's example, every refused space
as a ConfigError naming `tune.space.<path>`, the grid, the metric defaults per task and the storage's secret."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from pipeline_lib.config import (
    Choice,
    ConfigError,
    Direction,
    IntRange,
    LogUniform,
    Pruner,
    Sampler,
    Uniform,
    load_config,
    parse_config,
)
from pipeline_lib.core.secrets import MASK
from pipeline_lib.tuning import study as studies
from tests.pipeline_lib.tuning.support import tune_config

ISSUE_EXAMPLE = textwrap.dedent("""\
    name: digits
    data: {source: ./raw/digits.csv, label: target}
    train: {isolation: process}
    model: {factory: mlp, params: {hidden_units: [128, 64], dropout: 0.1}}
    tune:
      trials: 10
      parallel: 2
      space:
        train.base_learning_rate: {loguniform: [1.0e-4, 1.0e-1]}
        model.params.hidden_units: {choice: [[64], [128, 64]]}
        model.params.dropout: {uniform: [0.0, 0.5]}
        train.per_replica_batch_size: {int: [16, 128], step: 16}
    """)


def test_the_issues_example_parses_with_the_defaults_and_survives_its_own_dump(tmp_path):
    path = tmp_path / "digits.yaml"
    path.write_text(ISSUE_EXAMPLE)
    config = load_config(path)
    tune = config.tune
    assert (tune.trials, tune.parallel, tune.sampler, tune.pruner) == (10, 2, Sampler.TPE, Pruner.MEDIAN)
    assert (tune.metric, tune.direction, tune.seed, tune.study, tune.storage) == (None, None, None, None, None)
    space = tune.space
    assert space["train.base_learning_rate"] == LogUniform(loguniform=(1e-4, 0.1))
    assert space["model.params.hidden_units"] == Choice(choice=([64], [128, 64]))
    assert space["model.params.dropout"] == Uniform(uniform=(0.0, 0.5))
    assert space["train.per_replica_batch_size"] == IntRange(int=(16, 128), step=16)
    assert space["train.per_replica_batch_size"].grid_values() == list(range(16, 129, 16))
    # The YAML a run records loads back into the same config (`int` keeps its YAML name).
    dumped = config.masked_yaml()
    assert "int:" in dumped and load_config(_write(tmp_path, dumped)) == config
    # A config without a search dumps, and hashes, as before `tune` existed.
    plain = parse_config({"data": {"source": "x.csv", "label": "y"}})
    assert "tune" not in plain.masked_yaml() and "tune" not in plain.model_dump()


def _write(tmp_path, text):
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("space", "expected"), [
    ({"train.base_learning_rate": {"loguniform": [0.1, 0.001]}},
     ["tune.space.train.base_learning_rate.loguniform", "needs 0 < low < high, got [0.1, 0.001]"]),
    ({"train.base_learning_rate": {"loguniform": [0.0, 0.1]}},
     ["tune.space.train.base_learning_rate.loguniform", "needs 0 < low < high"]),
    ({"model.params.dropout": {"uniform": [0.5, 0.5]}},
     ["tune.space.model.params.dropout.uniform", "needs low < high, got [0.5, 0.5]"]),
    ({"train.per_replica_batch_size": {"int": [16, 120], "step": 16}},
     ["tune.space.train.per_replica_batch_size.int", "120 - 16 is not a multiple of 16; end it at 112 or 128"]),
    ({"model.params.hidden_units": {"choice": []}},
     ["tune.space.model.params.hidden_units.choice", "needs at least one value"]),
    ({"model.params.hidden_units": {"choice": [[64], [64]]}},
     ["tune.space.model.params.hidden_units.choice", "lists [64] more than once"]),
    ({"train.base_learning_rate": {"normal": [0, 1]}},
     ["tune.space.train.base_learning_rate", "must be one distribution"]),
    ({"train.epochz": {"int": [1, 3]}},
     ["tune.space.train.epochz: train.epochz is not a known key; allowed keys in train:", "epochs"]),
    ({"train.epochs.count": {"int": [1, 3]}},
     ["tune.space.train.epochs.count: train.epochs is a value, not a section"]),
    ({"data.label": {"choice": ["a", "b"]}},
     ["tune.space.data.label: data cannot be tuned: the data is converted once per study"]),
    ({"train.per_replica_batch_size": {"int": [0, 64], "step": 16}},
     ["tune.space.train.per_replica_batch_size can take 0, which the config refuses",
      "train.per_replica_batch_size: Input should be greater than or equal to 1"]),
    ({"train.optimizer": {"choice": ["adam", "rmsprop"]}},
     ["tune.space.train.optimizer can take 'rmsprop', which the config refuses", "'adam' or 'sgd'"]),
    ({"model.task": {"choice": ["classification", "regression"]}},
     ["tune.space.model.task can take 'regression', with which tune.metric ('accuracy') is not computed"]),
    ({"train.isolation": {"choice": ["process", "none"]}},
     ["tune.space.train.isolation can take 'none', with which train.isolation is 'none'"]),
], ids=["loguniform-reversed", "loguniform-zero", "uniform-empty", "int-step", "choice-empty", "choice-twice",
        "unknown-kind", "unknown-key", "under-a-value", "fixed-key", "schema-refuses-an-end",
        "schema-refuses-a-choice", "metric-not-computed-by-a-variant", "in-process-variant"])
def test_a_bad_space_is_a_config_error_naming_the_path_and_value(tmp_path, space, expected):
    with pytest.raises(ConfigError) as error:
        tune_config(str(tmp_path), space=space, metric="accuracy", source="pipe.yaml")
    message = str(error.value)
    assert "pipe.yaml" in message
    for part in expected:
        assert part in message


def test_a_free_form_mapping_takes_any_key_below_it(tmp_path):
    config = tune_config(str(tmp_path), space={"model.params.activation": {"choice": ["relu", "tanh"]},
                                               "model.params.new.nested": {"int": [1, 4]}})
    assert set(config.tune.space) == {"model.params.activation", "model.params.new.nested"}


def test_the_grid_takes_discrete_distributions_only(tmp_path):
    with pytest.raises(ConfigError, match=r"tune\.space\.train\.base_learning_rate is \{\"loguniform\": "
                                          r"\[0\.0001, 0\.1\]\}, a continuous range, but tune\.sampler grid"):
        tune_config(str(tmp_path), sampler="grid")
    config = tune_config(str(tmp_path), sampler="grid", trials=10, space={
        "model.params.hidden_units": {"choice": [[64], [128, 64], None]},
        "train.per_replica_batch_size": {"int": [16, 48], "step": 16}})
    assert config.tune.grid() == {"model.params.hidden_units": ["[64]", "[128, 64]", None],
                                  "train.per_replica_batch_size": [16, 32, 48]}
    assert config.tune.grid_size() == 9 and studies.budget(config) == 9  # 10 trials asked, 9 points


@pytest.mark.parametrize(("task", "tune", "gate", "expected"), [
    ("classification", {}, {}, ("eval_accuracy", Direction.MAX)),
    ("regression", {}, {}, ("eval_rmse", Direction.MIN)),
    ("regression", {"metric": "r2"}, {}, ("eval_r2", Direction.MAX)),
    ("classification", {"metric": "loss", "direction": "max"}, {}, ("eval_loss", Direction.MIN)),
    ("classification", {}, {"metric": "auc"}, ("eval_loss", Direction.MIN)),  # no AUC per checkpoint: as selection
    ("regression", {"metric": "r2", "direction": "min"}, {}, ("eval_r2", Direction.MIN)),
], ids=["classification", "regression", "regression-r2", "loss-always-min", "auc-gate", "declared-direction"])
def test_the_metric_and_direction_default_to_the_gates_after_the_task(tmp_path, task, tune, gate, expected):
    config = parse_config({"data": {"source": "x.csv", "label": "y"}, "output_root": str(tmp_path),
                           "model": {"task": task}, "evaluation": {"gate": gate},
                           "tune": {"space": {"train.base_learning_rate": {"uniform": [0.001, 0.01]}}, **tune}})
    assert studies.tuned_metric(config) == expected


@pytest.mark.parametrize(("settings", "expected"), [
    ({"train": {"isolation": "none"}},
     "train.isolation is 'none', but every trial trains in its own processes"),
    ({"tune": {"metric": "auc"}}, "tune.metric ('auc') is not computed by the trainer's evaluation at each checkpoint"),
    ({"tune": {"parallel": 2}, "observability": {"prometheus_port": 9400}},
     "observability.prometheus_port (9400) gives every trial's tasks the same port, and tune.parallel (2)"),
    ({"tune": {"parallel": 2}, "observability": {"profiler_port": 6009}},
     "observability.profiler_port (6009) gives every trial's tasks the same port"),
    ({"output_root": "s3://bucket/tfdag"},
     "tune.storage is left out, so the study would keep its journal file under output_root (s3://bucket/tfdag)"),
    ({"tune_trial": {"storage": "/tmp/j.log", "study": "s", "trial_number": 0, "metric": "eval_loss",
                     "direction": "min"}},
     "tune_trial is set beside tune"),
], ids=["in-process", "metric", "prometheus-port", "profiler-port", "remote-journal", "binding-beside-tune"])
def test_a_config_that_cannot_run_its_trials_is_refused_when_it_loads(settings, expected):
    data = {"name": "p", "data": {"source": "x.csv", "label": "y"},
            "tune": {"space": {"train.base_learning_rate": {"uniform": [0.001, 0.01]}}}}
    for key, value in settings.items():
        data[key] = {**data[key], **value} if key == "tune" else value
    with pytest.raises(ConfigError) as error:
        parse_config(data, "pipe.yaml")
    assert expected in str(error.value) and "pipe.yaml" in str(error.value)


def test_the_storage_url_password_is_masked_in_every_dump_and_resolved_where_the_study_opens(tmp_path, monkeypatch):
    literal = tune_config(str(tmp_path), storage="postgresql://tfdag:hunter2@db:5432/optuna")
    assert "hunter2" not in literal.masked_yaml() and "hunter2" not in repr(literal)
    assert f"postgresql://tfdag:{MASK}@db:5432/optuna" in literal.masked_yaml()
    assert studies.storage_shown(literal) == f"postgresql://tfdag:{MASK}@db:5432/optuna"
    assert studies.storage_url(literal) == "postgresql://tfdag:hunter2@db:5432/optuna"
    values, env = literal.for_process()  # a worker's spec: the password in its environment, not in the file
    assert "hunter2" not in yaml.safe_dump(values) and list(env.values()) == ["hunter2"]
    monkeypatch.setenv("OPTUNA_DB_PASSWORD", "s3cret")
    referenced = tune_config(str(tmp_path), storage="postgresql://tfdag:${OPTUNA_DB_PASSWORD}@db/optuna")
    assert studies.storage_url(referenced) == "postgresql://tfdag:s3cret@db/optuna"
    assert studies.storage_shown(referenced) == "postgresql://tfdag:${OPTUNA_DB_PASSWORD}@db/optuna"
    # The default: a journal file under output_root, in the study's directory (named after the pipeline).
    default = tune_config(str(tmp_path))
    assert studies.storage_url(default) == str(tmp_path / "tune" / "tune-test" / "journal.log")
    assert studies.storage_url(tune_config(str(tmp_path), study="lr")) == str(tmp_path / "tune" / "lr" / "journal.log")
