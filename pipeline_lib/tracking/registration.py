"""Whether a model goes into the registry (`tracking.register` and the model check) and whether the retrain flow
trains at all (new data): the rules, once, on the tracker's records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import RegisterPolicy
from pipeline_lib.data.manifest import SourceFingerprint
from pipeline_lib.tracking.records import CONFIG_HASH_TAG, VersionInfo

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


class TrainCheck(BaseModel):
    """Whether the retrain flow trains, and the message when it does not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: bool
    message: str
    version: int | None = None  # the version whose data matches, when skipping


def check_for_new_data(fingerprint: SourceFingerprint, config_hash: str, champion: VersionInfo | None,
                       latest: VersionInfo | None, refused_run_id: str | None = None) -> TrainCheck:
    """Train when the data differs from the champion's (and from a refused challenger's of the same config).

    `fingerprint` is `data.sources.source_fingerprint(config.data)`: the source files' paths, sizes and mtimes or
    etags (a listing, no content read) with the conversion settings, the same value the manifest records.

    A challenger refused on exactly this data and config would be retrained to the same refusal every night,
    so that case is skipped as well (`latest` when it was registered, else `refused_run_id`, from
    `last_refused_run`); change the data or the config (or pass `force`) to try again.
    """
    short = fingerprint.sha256[:12]
    if champion is not None and champion.source_fingerprint == fingerprint.sha256:
        return TrainCheck(train=False, version=champion.version,
                          message=f"no new data since version {champion.version} (the champion; source "
                                  f"fingerprint {short}, {len(fingerprint.files)} file(s))")
    if (latest is not None and latest.blessed is False and latest.source_fingerprint == fingerprint.sha256
            and latest.tags.get(CONFIG_HASH_TAG) == config_hash):
        return TrainCheck(train=False, version=latest.version,
                          message=f"no new data since version {latest.version}, which was not promoted with this "
                                  f"same config (source fingerprint {short}); change the data or the "
                                  "config, or pass force=true, to train again")
    if refused_run_id is not None:
        return TrainCheck(train=False,
                          message=f"no new data since MLflow run {refused_run_id}, whose model was not blessed with "
                                  f"this same config (source fingerprint {short}); change the data or the config, "
                                  "or pass force=true, to train again")
    if champion is None:
        return TrainCheck(train=True, message="no champion yet: training the first model")
    seen = champion.source_fingerprint[:12] if champion.source_fingerprint else "untagged"
    return TrainCheck(train=True, message=f"new data: source fingerprint {short} differs from the "
                                          f"champion's (version {champion.version}, {seen})")
