"""A tuning trial's pruner on the training side: the chief reports the tuned metric of each evaluation to its trial
and, on the checkpoint cadence, asks the study's pruner whether to stop; a prune ends training at an agreed step like
an early stop (`training.early_stopping.StopRule`), recorded as pruned in the TrainResult.

Only the chief of a trial (`tune_trial` set) builds one, in the worker; a restarted group reports on from where it
resumed (steps already reported are not sent again) and asks at its next evaluation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import optuna

from pipeline_lib.config import PipelineConfig, Pruner, TrialBinding
from pipeline_lib.core import storage
from pipeline_lib.training.early_stopping import EarlyStop, as_good
from pipeline_lib.tuning.study import create_pruner, create_storage, quiet_optuna

logger = logging.getLogger(__name__)


class TrialPruning:
    """The stop rule of one trial's chief: reports `binding.metric` at each evaluation to `trial`, and at each
    evaluation on the cadence (`every_steps`) asks its pruner.

    Args:
        trial: the running trial, of a study loaded with the study's pruner.
        binding: the config's `tune_trial`.
        every_steps: `train.checkpoint_every_steps`; only evaluations on it are asked about (a preemption's or the
            last step's save is reported, not asked about).
        reported: the steps the trial already holds a value for (a restarted group's earlier evaluations).
    """

    def __init__(self, trial: optuna.Trial, binding: TrialBinding, every_steps: int, reported: set[int] | None = None):
        self.trial, self.binding, self.every_steps = trial, binding, every_steps
        self.reported = set(reported or ())
        self.best_step: int | None = None
        self.best_value = math.nan
        self._stop: EarlyStop | None = None

    @classmethod
    def open(cls, config: PipelineConfig) -> TrialPruning:
        """Load the trial `config.tune_trial` names from its study.

        Raises:
            ValueError: when the config has no `tune_trial`.
            KeyError: when the study or the trial is not in the storage.
        """
        binding = config.tune_trial
        if binding is None:
            raise ValueError(f"the config of pipeline {config.name!r} has no tune_trial: it is no tuning trial's")
        quiet_optuna()
        every_steps = config.train.checkpoint_every_steps
        # A literal password reached this process as a `${TFDAG_SECRET_…}` reference in its environment.
        study_storage = create_storage(storage.expand_env(binding.storage, "tune_trial.storage"))
        study = optuna.load_study(
            study_name=binding.study, storage=study_storage, sampler=optuna.samplers.RandomSampler(),
            pruner=create_pruner(binding.pruner, binding.startup_trials, every_steps))
        study_id = study_storage.get_study_id_from_name(binding.study)
        trial_id = study_storage.get_trial_id_from_study_id_trial_number(study_id, binding.trial_number)
        reported = set(study_storage.get_trial(trial_id).intermediate_values)
        return cls(optuna.Trial(study, trial_id), binding, every_steps, reported)

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Report the evaluation at `step` (once per step) and, on the cadence, ask the pruner."""
        value = metrics.get(self.binding.metric)
        if value is None:
            return
        value = float(value)
        if as_good(value, self.best_value, self.binding.direction):
            self.best_step, self.best_value = step, value
        if step not in self.reported and math.isfinite(value):
            self.trial.report(value, step)
            self.reported.add(step)
        asks = self._stop is None and self.binding.pruner != Pruner.NONE and step % self.every_steps == 0
        if asks and self.trial.should_prune():
            best_step = self.best_step if self.best_step is not None else step
            best_value = self.best_value if self.best_step is not None else value
            self._stop = EarlyStop(best_step, best_value, self.describe(step, value, best_step, best_value),
                                   pruned=True)
            logger.info("%s", self._stop.reason)

    def outcome(self) -> EarlyStop | None:
        """The prune decided at an evaluation, None while the trial goes on."""
        return self._stop

    def describe(self, step: int, value: float, best_step: int, best_value: float) -> str:
        """Why the trial stopped, e.g. `pruned by the median pruner at step 40 (trial 3 of study digits):
        eval_accuracy 0.312 there against the study's other trials; best 0.35 at step 30`."""
        return (f"pruned by the {self.binding.pruner.value} pruner at step {step} (trial {self.binding.trial_number} "
                f"of study {self.binding.study}): {self.binding.metric} {value:.4g} there against the study's other "
                f"trials; best {best_value:.4g} at step {best_step}")
