"""A config's Optuna study: its name, storage (a journal file or a database), direction, sampler and pruner;
`open_study` creates or resumes it, `recover_stale_trials` fails what a dead process left running, `counted` is
how much of `tune.trials` is done."""

from __future__ import annotations

import logging
import os

import optuna
from optuna.trial import TrialState

from pipeline_lib.checkpoints import selection
from pipeline_lib.config import (
    ConfigError,
    Direction,
    PipelineConfig,
    Pruner,
    Sampler,
    TuneConfig,
    metric_direction,
)
from pipeline_lib.config.tune_space import tune_of
from pipeline_lib.core import storage
from pipeline_lib.core.quiet import is_verbose
from pipeline_lib.core.secrets import mask_url_passwords

logger = logging.getLogger(__name__)

TUNE_DIR = "tune"
JOURNAL_NAME = "journal.log"
METRIC_ATTR = "tfdag.metric"  # the study's user attribute: the checkpoint metric it optimizes
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)  # the trials that count toward tune.trials


def study_name(config: PipelineConfig) -> str:
    """`tune.study`, else the pipeline's `name`."""
    return tune_of(config).study or config.name


def study_dir(config: PipelineConfig) -> str:
    """`<output_root>/tune/<study>`: the default journal and every trial's directory (absolute when local)."""
    root = config.output_root
    root = storage.local_path(root) if storage.is_local(root) else root
    return storage.join(root, TUNE_DIR, study_name(config))


def storage_url(config: PipelineConfig) -> str:
    """Where the study lives, references resolved (may hold a password: show `storage_shown`): `tune.storage`, a
    database URL or a journal file's path, else the journal file `<output_root>/tune/<study>/journal.log`."""
    value = tune_of(config).storage
    if value is None:
        return storage.join(study_dir(config), JOURNAL_NAME)
    return storage.expand_env(value, "tune.storage")


def storage_shown(config: PipelineConfig) -> str:
    """`storage_url` as a log line or a summary may show it: a URL's password masked, references as written."""
    value = tune_of(config).storage
    return mask_url_passwords(value) if value is not None else storage_url(config)


def tuned_metric(config: PipelineConfig) -> tuple[str, Direction]:
    """The checkpoint metric the study optimizes (`eval_<name>`) and its direction.

    `tune.metric` when set, else the one best-checkpoint selection ranks by (the gate metric as the trainer records
    it), so a trial's value is measured where `select: best` picks its checkpoint. The direction is
    `metric_direction(metric, tune.direction or evaluation.gate.direction)`: loss, mae and rmse always fall.
    """
    tune = tune_of(config)
    declared = tune.direction or config.evaluation.gate.direction
    if tune.metric is None:
        metric, _ = selection.selection_metric(config)
    else:
        metric = f"eval_{tune.metric.removeprefix('eval_')}"
    return metric, metric_direction(metric, declared)


def create_storage(url: str) -> optuna.storages.BaseStorage:
    """The storage at `url`: a database URL (`scheme://...`, SQLAlchemy's form) is an RDBStorage; anything else is
    the path of a journal file (its directory made), which survives a crash and takes parallel writers on one
    machine (a file lock)."""
    if "://" in url:
        return optuna.storages.RDBStorage(url)
    path = os.path.abspath(os.path.expanduser(url))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler without its stop: its `after_trial` calls `Study.stop`, which only works inside
    `Study.optimize` and raises under ask and tell; the runner stops at the grid's size itself."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def create_sampler(tune: TuneConfig) -> optuna.samplers.BaseSampler:
    """`tune.sampler` seeded with `tune.seed`: TPE, random, or the grid of the choices and int ranges."""
    if tune.sampler == Sampler.GRID:
        return _AskTellGridSampler(tune.grid(), seed=tune.seed)
    if tune.sampler == Sampler.RANDOM:
        return optuna.samplers.RandomSampler(seed=tune.seed)
    return optuna.samplers.TPESampler(seed=tune.seed)


def create_pruner(kind: Pruner, startup_trials: int, every_steps: int) -> optuna.pruners.BasePruner:
    """The pruner `kind`: the median one after `startup_trials` completed trials, from the first evaluation on;
    Hyperband with its first rung at the first evaluation (`every_steps`, `train.checkpoint_every_steps`); or none.
    """
    if kind == Pruner.MEDIAN:
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if kind == Pruner.HYPERBAND:
        return optuna.pruners.HyperbandPruner(min_resource=every_steps)
    return optuna.pruners.NopPruner()


def open_study(config: PipelineConfig) -> optuna.Study:
    """Create the config's study, or load it when it exists (the same command resumes it).

    Raises:
        ConfigError: when the stored study optimizes another metric or direction than this config resolves to.
    """
    quiet_optuna()
    tune = tune_of(config)
    metric, direction = tuned_metric(config)
    name = study_name(config)
    study = optuna.create_study(
        storage=create_storage(storage_url(config)), study_name=name, load_if_exists=True,
        direction="maximize" if direction == Direction.MAX else "minimize", sampler=create_sampler(tune),
        pruner=create_pruner(tune.pruner, tune.startup_trials, config.train.checkpoint_every_steps))
    recorded = study.user_attrs.get(METRIC_ATTR)
    if recorded is None:
        study.set_user_attr(METRIC_ATTR, metric)
        recorded = metric
    stored = Direction.MAX if study.direction == optuna.study.StudyDirection.MAXIMIZE else Direction.MIN
    if (recorded, stored) != (metric, direction):
        raise ConfigError(f"study {name!r} in {storage_shown(config)} optimizes {recorded} ({stored.value}), but "
                          f"this config's tune.metric and direction resolve to {metric} ({direction.value}); set "
                          "tune.study to a new name for a new study, or tune.metric back")
    return study


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Mark FAIL every trial the storage still holds RUNNING and return their numbers.

    Called once when a study starts, by the one process that runs it: any trial RUNNING then was left by a process
    that died (a killed flow), and its budget goes to a new trial (`counted` does not count it).
    """
    stale = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    for number in stale:
        study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
    if stale:
        logger.warning("study %s: trial(s) %s were left running by a process that ended; marked failed, their "
                       "budget goes to new trials", study.study_name, stale)
    return stale


def counted(study: optuna.Study) -> int:
    """The trials that count toward `tune.trials`: complete and pruned ones (a failed one does not)."""
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def budget(config: PipelineConfig) -> int:
    """How many trials the study runs: `tune.trials`, at most the grid's size with the grid sampler (each point once;
    a failed point is not tried again)."""
    tune = tune_of(config)
    return min(tune.trials, tune.grid_size()) if tune.sampler == Sampler.GRID else tune.trials


def quiet_optuna() -> None:
    """Optuna's INFO lines (a study created, each trial finished) off unless verbose: tfdag logs its own."""
    if not is_verbose():
        optuna.logging.set_verbosity(optuna.logging.WARNING)
