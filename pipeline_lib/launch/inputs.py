"""Every input that can be checked before a flow starts: the model factory, TF_CONFIG and storage."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline_lib.cluster.check import validate_cluster
from pipeline_lib.cluster.report import ClusterReport
from pipeline_lib.config import ConfigError, PipelineConfig
from pipeline_lib.core import storage
from pipeline_lib.data import demo
from pipeline_lib.launch import launchers
from pipeline_lib.training import models


@dataclass(frozen=True)
class InputCheck:
    """What was proved before anything ran: the storage URIs that answered and the cluster report."""

    storage_checked: tuple[str, ...]
    cluster_report: ClusterReport


def check_inputs(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> InputCheck:
    """Check what a run needs from its input, cheapest first, before conversion or any cluster starts.

    The config's own values were checked when it was parsed. This adds what needs the world: the launcher's own
    checks (`Launcher.check_inputs`: for Ray, train.ray.address or RAY_ADDRESS), the model factory's
    import path and signature, TF_CONFIG against the strategy, and every storage URI with its credentials (the bundled demo
    source is written first when the config names it, as the flow would).

    Raises:
        UserError: the first input that cannot work (ModelFactoryError, ClusterConfigError, StorageAccessError),
            naming the value, where it came from and the fix.
    """
    launchers.check_inputs(config, environ)
    if config.model.factory not in models.BUILTINS:
        models.import_factory(config.model.factory)
    if config.validation.enabled and config.validation.against == "champion" and not config.tracking.registered_model:
        raise ConfigError("validation.against is 'champion' but tracking.registered_model is not set, so there is "
                          "no champion; set tracking.registered_model, or validation.against: latest")
    report = validate_cluster(config, environ)
    demo.ensure_demo_source(config.data)
    checked = storage.check_storage(config)
    return InputCheck(storage_checked=checked, cluster_report=report)
