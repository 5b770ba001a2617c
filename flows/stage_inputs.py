"""What the CLI's stage commands start from, built one way: the config (`flow_config.load`, which resolves
`${prefect-secret:NAME}` references too), its converted data, the shard plan."""

from __future__ import annotations

from dataclasses import dataclass

from flows.flow_config import load
from pipeline_lib.config import PipelineConfig
from pipeline_lib.data import demo as demo_data
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning import sharding
from pipeline_lib.training import strategy


@dataclass(frozen=True)
class StageInputs:
    """A config and its converted data: what convert, plan, validate-data, train and evaluate share."""

    config: PipelineConfig
    manifest: Manifest

    def plan(self, num_workers: int | None = None) -> sharding.ShardPlan:
        """The shard plan training uses (`num_workers`: plan for that many workers instead of train.workers)."""
        train = self.config.train
        return sharding.plan_for_train(self.manifest, train, strategy.replicas_per_worker(train),
                                       num_workers=num_workers)


def stage_inputs(path: str | None) -> StageInputs:
    """Load the config, write the demo's source data when the config reads it and it is missing, and convert the
    data (a conversion already done is reused: same fingerprint, same manifest)."""
    config = load(path)
    demo_data.ensure_demo_source(config.data)
    return StageInputs(config, convert(config.data, config.output_root, config.storage_options, ray=config.train.ray))
