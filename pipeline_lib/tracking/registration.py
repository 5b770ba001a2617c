"""Whether a model goes into the registry: the one rule, `tracking.register` and the model check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline_lib.config import RegisterPolicy

if TYPE_CHECKING:
    from pipeline_lib.evaluation.report import GateDecision
    from pipeline_lib.serving.validation import ModelValidation


def why_not_registered(policy: RegisterPolicy, decision: GateDecision,
                       validation: ModelValidation | None = None) -> str | None:
    """None when `tracking.register` puts this model in the registry, else why not.

    A blessed model is registered; another only with `always` (tagged blessed=false, without an alias); a model that
    failed the model check before registration (`serving.validation`) never: it does not load, or does not predict
    what was evaluated.
    """
    if validation is not None and not validation.passed:
        return "the model check failed"
    if decision.blessed or policy == RegisterPolicy.ALWAYS:
        return None
    return "not blessed"
