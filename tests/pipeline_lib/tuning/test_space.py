"""pipeline_lib.tuning.space: sampled values set into a config by their paths (secrets kept), a trial's config, and
`suggest` over every kind of distribution on a real Optuna study."""

from __future__ import annotations

import math

import optuna
import pytest

from pipeline_lib.config import (
    ConfigError,
    Direction,
    Pruner,
    TrialBinding,
    parse_config,
)
from pipeline_lib.core.secrets import MASK
from pipeline_lib.tuning import space
from tests.pipeline_lib.tuning.support import tune_config

SPACE = {
    "train.base_learning_rate": {"loguniform": [1.0e-4, 1.0e-1]},
    "model.params.dropout": {"uniform": [0.0, 0.5]},
    "train.per_replica_batch_size": {"int": [16, 128], "step": 16},
    "train.warmup_steps": {"int": [1, 1000], "log": True},
    "model.params.hidden_units": {"choice": [[64], [128, 64]]},
    "train.optimizer": {"choice": ["adam", "sgd"]},
}


def test_apply_sets_nested_paths_and_validates_the_whole_config(tmp_path):
    config = tune_config(str(tmp_path))
    applied = space.apply(config, {"train.base_learning_rate": 0.02, "model.params.hidden_units": [128, 64],
                                   "model.params.extra.depth": 3, "evaluation.gate.threshold": 0.8})
    assert applied.train.base_learning_rate == 0.02
    assert applied.model.params == {"hidden_units": [128, 64], "extra": {"depth": 3}}
    assert applied.evaluation.gate.threshold == 0.8
    assert applied.evaluation.gate.metric == "accuracy"  # the task's defaults derived again
    assert config.train.base_learning_rate == 1e-3 and config.model.params == {"hidden_units": [8]}  # unchanged
    with pytest.raises(ConfigError) as error:
        space.apply(config, {"train.per_replica_batch_size": 0, "train.base_learning_rate": 0.01})
    message = str(error.value)
    assert "train.per_replica_batch_size = 0" in message
    assert "train.per_replica_batch_size: Input should be greater than or equal to 1" in message


def test_apply_keeps_a_literal_secret_a_secret_not_a_mask(tmp_path):
    config = parse_config({"data": {"source": "x.csv", "label": "y"}, "output_root": str(tmp_path),
                           "storage_options": {"key": "AKIA", "secret": "hunter2"},
                           "tune": {"space": {"train.epochs": {"int": [1, 3]}}}})
    applied = space.apply(config, {"train.epochs": 2})
    assert applied.storage_options == {"key": "AKIA", "secret": "hunter2"}
    assert "hunter2" not in applied.masked_yaml() and MASK in applied.masked_yaml()


def test_a_trials_config_has_no_search_and_its_binding(tmp_path):
    config = tune_config(str(tmp_path), storage="postgresql://u:hunter2@db/optuna")
    binding = TrialBinding(storage="postgresql://u:hunter2@db/optuna", study="s", trial_number=4,
                           metric="eval_accuracy", direction=Direction.MAX, pruner=Pruner.HYPERBAND)
    trial = space.apply(config, {"train.base_learning_rate": 0.05}, tune_trial=binding)
    assert trial.tune is None and trial.tune_trial == binding and trial.train.base_learning_rate == 0.05
    assert "hunter2" not in trial.masked_yaml()
    values, env = trial.for_process()  # the chief's spec: the password travels in its environment only
    assert values["tune_trial"]["storage"].startswith("postgresql://u:${TFDAG_SECRET_") and "hunter2" in env.values()


def test_suggest_samples_every_kind_within_its_range_and_maps_choices_back(tmp_path):
    config = tune_config(str(tmp_path), space=SPACE)
    distributions = config.tune.space
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    sampled = []
    for _ in range(30):
        trial = study.ask()
        values = space.suggest(trial, distributions)
        sampled.append(values)
        assert set(values) == set(SPACE)
        assert 1e-4 <= values["train.base_learning_rate"] <= 0.1
        assert 0.0 <= values["model.params.dropout"] <= 0.5
        assert values["train.per_replica_batch_size"] in range(16, 129, 16)
        assert isinstance(values["train.warmup_steps"], int) and 1 <= values["train.warmup_steps"] <= 1000
        assert values["model.params.hidden_units"] in ([64], [128, 64])
        assert values["train.optimizer"] in ("adam", "sgd")
        # Optuna records the choice as its key; values_of reads the value back.
        assert trial.params["model.params.hidden_units"] in ("[64]", "[128, 64]")
        assert space.values_of(trial.params, distributions) == values
        space.apply(config, values)  # every sample makes a valid config
        study.tell(trial, 0.0)
    assert {tuple(v["model.params.hidden_units"]) for v in sampled} == {(64,), (128, 64)}
    # loguniform spreads over the decades; a seeded sampler repeats itself.
    decades = {math.floor(math.log10(v["train.base_learning_rate"])) for v in sampled}
    assert len(decades) >= 3
    again = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    assert [space.suggest(again.ask(), distributions) for _ in range(3)] == sampled[:3]
