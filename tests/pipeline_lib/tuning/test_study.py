"""pipeline_lib.tuning.study: the study on its journal file (resumed by the same call), stale trials of a dead
process failed and not counted, a database URL, the grid under ask and tell, and a study that optimizes another
metric refused."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from pipeline_lib.config import ConfigError, Pruner
from pipeline_lib.tuning import space
from pipeline_lib.tuning import study as studies
from tests.pipeline_lib.tuning.support import tune_config


def _run(study, config, count):
    """`count` trials of a trivial objective through ask and tell: the learning rate itself."""
    for _ in range(count):
        trial = study.ask()
        study.tell(trial, space.suggest(trial, config.tune.space)["train.base_learning_rate"])


def test_the_journal_file_keeps_the_study_and_the_same_call_resumes_it(tmp_path):
    config = tune_config(str(tmp_path), seed=3)
    study = studies.open_study(config)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE  # eval_accuracy
    _run(study, config, 2)
    journal = tmp_path / "tune" / "tune-test" / "journal.log"
    assert journal.is_file() and journal.stat().st_size > 0
    again = studies.open_study(config)
    assert [t.state for t in again.trials] == [TrialState.COMPLETE] * 2
    assert [t.params for t in again.trials] == [t.params for t in study.trials]
    assert studies.counted(again) == 2 and again.user_attrs[studies.METRIC_ATTR] == "eval_accuracy"
    _run(again, config, 1)
    assert studies.counted(studies.open_study(config)) == 3


def test_a_trial_left_running_by_a_dead_process_is_failed_and_not_counted(tmp_path):
    config = tune_config(str(tmp_path))
    study = studies.open_study(config)
    _run(study, config, 1)
    pruned = study.ask()
    pruned.report(0.1, step=10)
    study.tell(pruned, state=TrialState.PRUNED)
    study.ask()  # a trial whose process died: nobody tells it
    resumed = studies.open_study(config)
    assert [t.state for t in resumed.trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING]
    assert studies.recover_stale_trials(resumed) == [2]
    assert [t.state for t in resumed.trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL]
    assert studies.counted(resumed) == 2  # complete and pruned count; the failed one's budget goes to a new trial
    assert studies.recover_stale_trials(studies.open_study(config)) == []


def test_a_database_url_holds_the_study_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    config = tune_config(str(tmp_path), storage=url, metric="loss")
    assert isinstance(studies.create_storage(url), optuna.storages.RDBStorage)
    study = studies.open_study(config)
    assert study.direction == optuna.study.StudyDirection.MINIMIZE  # eval_loss
    _run(study, config, 1)
    assert optuna.study.get_all_study_names(storage=url) == ["tune-test"]
    assert studies.counted(studies.open_study(config)) == 1
    assert not (tmp_path / "tune").exists()  # no journal beside it


def test_a_stored_study_of_another_metric_is_refused(tmp_path):
    studies.open_study(tune_config(str(tmp_path)))
    with pytest.raises(ConfigError) as error:
        studies.open_study(tune_config(str(tmp_path), metric="loss"))
    assert ("study 'tune-test' in " + str(tmp_path / "tune" / "tune-test" / "journal.log") + " optimizes "
            "eval_accuracy (max), but this config's tune.metric and direction resolve to eval_loss (min)") \
        in str(error.value)


def test_the_grid_runs_every_point_once_under_ask_and_tell(tmp_path):
    config = tune_config(str(tmp_path), sampler="grid", trials=10, seed=0, space={
        "model.params.hidden_units": {"choice": [[8], [16, 8]]}, "train.per_replica_batch_size": {"int": [16, 32],
                                                                                                "step": 16}})
    study = studies.open_study(config)
    seen = []
    for _ in range(studies.budget(config)):
        trial = study.ask()
        values = space.suggest(trial, config.tune.space)
        seen.append((tuple(values["model.params.hidden_units"]), values["train.per_replica_batch_size"]))
        study.tell(trial, 0.5)  # Optuna's GridSampler alone would raise here: Study.stop outside optimize
    assert sorted(seen) == [((8,), 16), ((8,), 32), ((16, 8), 16), ((16, 8), 32)]


@pytest.mark.parametrize(("kind", "expected"), [(Pruner.MEDIAN, optuna.pruners.MedianPruner),
                                               (Pruner.HYPERBAND, optuna.pruners.HyperbandPruner),
                                               (Pruner.NONE, optuna.pruners.NopPruner)])
def test_each_pruner(kind, expected):
    assert isinstance(studies.create_pruner(kind, 2, 10), expected)
