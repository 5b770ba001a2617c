"""A tuning trial's pruner (`tuning.pruning`) as the chief's loop action."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline_lib.training.actions.base import LoopAction
from pipeline_lib.training.early_stopping import EarlyStop, StopRule


class PruneTrial(LoopAction):
    """The chief reports each evaluation to its trial's stop rule, whose prune ends training at the agreed step like an
    early stop. Not replayed on a restore, unlike early stopping: its outcome may depend on what other processes did
    since (the study's other trials)."""

    def __init__(self, rule: StopRule):
        self.rule = rule

    def on_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rule.observe(step, metrics)

    def stop_outcome(self) -> EarlyStop | None:
        return self.rule.outcome()
