"""`reproduce(run_id)`: read a run's record from MLflow, check its data, retrain deterministically, compare weights.

The run's artifacts (`tracking.reproducibility`) give the resolved config, the manifest and shard plan, the
record (strategy, workers, seeds, the exported checkpoint's step), the exported weights and `pip freeze`. The
rerun trains on the recorded TFRecords when every shard's digest still matches; otherwise it converts the
recorded source again into its own directory and requires the recorded fingerprint and manifest hash.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import yaml

from pipeline_lib.config import ConfigError, PipelineConfig, Strategy, parse_config
from pipeline_lib.core import digests, runs, storage
from pipeline_lib.core.errors import UserError
from pipeline_lib.core.secrets import is_masked
from pipeline_lib.data.convert import convert
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.evaluation.consolidation import restore_model
from pipeline_lib.launch import launchers
from pipeline_lib.planning.sharding import ShardPlan
from pipeline_lib.tracking import reproducibility as recorded
from pipeline_lib.tracking.tracker import TrackedRun, TrackingError, open_recorded_run

logger = logging.getLogger(__name__)


class ReproduceError(UserError, RuntimeError):
    """The run cannot be reproduced as asked: not found, not recorded, not deterministic, or its config masked."""


@dataclasses.dataclass(frozen=True)
class RecordedRun:
    """What a tracked run recorded for its rerun, read back from MLflow."""

    run_id: str
    config: PipelineConfig
    record: recorded.ReproductionRecord
    manifest: Manifest
    plan: ShardPlan
    weights: dict[str, np.ndarray]
    versions: dict[str, str]  # from its pip freeze


@dataclasses.dataclass(frozen=True)
class ReproduceOutcome:
    """The verdict: reproduced or not, with every difference found."""

    run_id: str
    reproduced: bool
    identical: bool  # every weight bit for bit
    tolerance: float | None
    differences: dict[str, float]  # variable -> largest absolute difference (nan: missing on one side), non-zero only
    num_variables: int
    data_problems: tuple[str, ...]  # why the data is not the run's (then nothing was retrained)
    version_differences: tuple[str, ...]  # "name recorded → installed"
    strategy: str
    num_workers: int
    launcher: str  # the launcher the rerun trained under: the run's own (`launch.launchers`)
    export_step: int
    run_dir: str | None

    def report_lines(self) -> list[str]:
        """What `tfdag reproduce` prints: the verdict first, then each difference."""
        lines = []
        if self.data_problems:
            lines.append(f"NOT reproduced: run {self.run_id}'s data is not there as recorded")
            lines += [f"  data: {problem}" for problem in self.data_problems]
        elif self.reproduced:
            how = ("bit-identical weights" if self.identical else
                   f"weights within --tolerance {self.tolerance:g} (largest difference "
                   f"{max(self.differences.values(), default=0.0):.3g})")
            lines.append(f"reproduced run {self.run_id}: {how}, {self.num_variables} variable(s) at step "
                         f"{self.export_step} ({self.strategy}, {self.num_workers} worker(s)) on the {self.launcher} "
                         "launcher")
        else:
            bound = "are not bit-identical" if self.tolerance is None else f"differ by more than {self.tolerance:g}"
            lines.append(f"NOT reproduced: the weights of run {self.run_id} at step {self.export_step} {bound}; "
                         "largest difference per variable:")
            lines += [f"  {name}: {'missing on one side' if math.isnan(diff) else f'{diff:.6g}'}"
                      for name, diff in sorted(self.differences.items())]
        if self.version_differences and not self.reproduced:
            lines.append("package versions that differ from the run's (recorded → installed):")
            lines += [f"  {line}" for line in self.version_differences]
        elif self.version_differences:
            lines.append(f"({len(self.version_differences)} package version(s) differ from the run's; "
                         "the weights did not change)")
        return lines


def _download(run: TrackedRun, path: str, *, required: bool = True) -> bytes | None:
    try:
        return run.read_artifact(path)
    except Exception as error:
        if not required:
            return None
        raise ReproduceError(
            f"MLflow run {run.run_id} has no artifact {path!r} ({type(error).__name__}); it was tracked by a tfdag "
            "without `reproduce` records, or the artifact was deleted: rerun the pipeline to get a reproducible run"
        ) from error


def _masked_keys(value: Any, where: str = "") -> list[str]:
    if isinstance(value, dict):
        return [k for key, item in value.items() for k in _masked_keys(item, f"{where}.{key}" if where else key)]
    if isinstance(value, list):
        return [k for i, item in enumerate(value) for k in _masked_keys(item, f"{where}[{i}]")]
    return [where] if is_masked(value) else []


def _config_from(text: str, run_id: str) -> PipelineConfig:
    data = yaml.safe_load(text) or {}
    masked = _masked_keys(data)
    if masked:
        raise ReproduceError(
            f"the config recorded with run {run_id} masks {', '.join(masked)} (a credential written as a value, "
            "not a ${ENV} reference), so the run cannot be rerun from it; write such options as \"${VARIABLE}\" "
            "references in the pipeline YAML so that the record keeps the reference")
    train = data.get("train")
    if isinstance(train, dict) and "early_stopping" not in train:
        # Recorded before train.early_stopping existed (a record holds every key): that run trained to its ceiling.
        data["train"] = {**train, "early_stopping": {"enabled": False}}
    try:
        return parse_config(data, source=f"{recorded.CONFIG_ARTIFACT} of run {run_id}")
    except ConfigError as error:
        raise ReproduceError(f"{error}; the recorded config no longer validates with this tfdag") from None


def load_recorded_run(run_id: str, tracking_uri: str) -> RecordedRun:
    """Read a run's record, config, manifest, shard plan, weights and pip freeze from MLflow.

    Raises:
        ReproduceError: when the run does not exist or lacks a record.
    """
    try:
        run = open_recorded_run(tracking_uri, run_id)
    except TrackingError as error:
        raise ReproduceError(str(error)) from error
    config = _config_from(_download(run, recorded.CONFIG_ARTIFACT).decode(), run_id)
    record = recorded.ReproductionRecord.model_validate_json(_download(run, recorded.RECORD_ARTIFACT))
    manifest = Manifest.model_validate_json(_download(run, recorded.MANIFEST_ARTIFACT))
    plan = ShardPlan.model_validate_json(_download(run, recorded.SHARD_PLAN_ARTIFACT))
    weights = recorded.weights_from_npz(_download(run, recorded.WEIGHTS_ARTIFACT))
    freeze = _download(run, recorded.PIP_FREEZE_ARTIFACT, required=False)
    versions = recorded.parse_pip_freeze(freeze.decode()) if freeze else {}
    return RecordedRun(run_id=run_id, config=config, record=record, manifest=manifest, plan=plan, weights=weights,
                       versions=versions)


def _shard_problems(manifest: Manifest, storage_options: dict[str, Any]) -> list[str]:
    """Every shard of `manifest` that is missing or whose digest is not the recorded one."""
    problems = []
    for shard in manifest.shards:
        uri = manifest.shard_uri(shard)
        try:
            fs, path = storage.get_fs(uri, storage_options)
            digest = digests.file_digest(fs, path, manifest.shard_digest) if fs.exists(path) else None
        except Exception as error:  # noqa: BLE001 - any storage error means the shard cannot be used
            problems.append(f"{uri} cannot be read ({error})")
            continue
        if digest is None:
            problems.append(f"{uri} is missing")
        elif digest != shard.digest:
            problems.append(f"{uri} has {manifest.shard_digest.value} {digest[:12]}…, the run recorded "
                            f"{shard.digest[:12]}…")
    return problems


def check_data(run: RecordedRun, convert_root: str) -> tuple[Manifest | None, list[str]]:
    """The run's TFRecords: the recorded ones when intact, else the recorded source converted again.

    Returns:
        (manifest to train on, []) or (None, [why the data is not the run's]).
    """
    config, record = run.config, run.record
    problems = _shard_problems(run.manifest, config.storage_options)
    if not problems:
        return run.manifest, []
    logger.warning("the run's TFRecords are not intact (%s); converting %s again into %s", "; ".join(problems),
                   config.data.source, convert_root)
    try:
        manifest = convert(config.data, convert_root, config.storage_options, ray=config.train.ray)
    except Exception as error:  # noqa: BLE001 - reported as the reason the data is not there
        return None, [*problems, f"converting data.source {config.data.source!r} again failed: {error}"]
    found = []
    if manifest.fingerprint != record.data_fingerprint:
        found.append(f"data fingerprint: the run recorded {record.data_fingerprint}, converting data.source "
                     f"{config.data.source!r} again gives {manifest.fingerprint} (the source files or the data "
                     "settings changed)")
    elif manifest.content_hash() != record.manifest_hash:
        found.append(f"manifest hash: the run recorded {record.manifest_hash[:16]}…, the converted TFRecords "
                     f"hash to {manifest.content_hash()[:16]}… (the conversion wrote different shards)")
    return (manifest, []) if not found else (None, [*problems, *found])


def compare_weights(expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> dict[str, float]:
    """{variable: largest absolute difference} for every variable not bit-identical (nan: missing on one side)."""
    differences = {}
    for name in sorted(set(expected) | set(actual)):
        if name not in expected or name not in actual or expected[name].shape != actual[name].shape:
            differences[name] = math.nan
        elif not np.array_equal(expected[name], actual[name]) or expected[name].dtype != actual[name].dtype:
            delta = np.abs(expected[name].astype(np.float64) - actual[name].astype(np.float64))
            differences[name] = float(np.max(delta)) if delta.size else 0.0
    return differences


def _rerun_config(run: RecordedRun) -> PipelineConfig:
    """The recorded config pinned to the recorded strategy and worker count (an `auto` could resolve otherwise)."""
    train = run.config.train.model_copy(update={"strategy": Strategy(run.record.strategy),
                                                "workers": run.record.num_workers})
    return run.config.model_copy(update={"train": train})


def reproduce(run_id: str, tracking_uri: str, *, tolerance: float | None = None, work_dir: str | None = None,
              log_fn: Callable[[str], None] = print) -> ReproduceOutcome:
    """Retrain a tracked run in deterministic mode and compare its weights with the run's exported model.

    Args:
        run_id: the MLflow run id.
        tracking_uri: the MLflow store the run is in.
        tolerance: compare within this absolute bound instead of bit for bit; lets a non-deterministic run through.
        work_dir: where the rerun's run directory (and a re-conversion) go; default `<output_root>/reproduce`.
        log_fn: where the workers' log lines go.

    Returns:
        The ReproduceOutcome.

    Raises:
        ReproduceError: when the run is missing, unrecorded, not deterministic (without a tolerance) or masked.
    """
    if tolerance is not None and not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ReproduceError(f"--tolerance ({tolerance}) must be a finite number ≥ 0, e.g. 1e-6")
    run = load_recorded_run(run_id, tracking_uri)
    record = run.record
    reason = record.why_not_reproducible()
    if reason is not None and tolerance is None:
        raise ReproduceError(f"run {run_id} cannot be reproduced bit for bit: {reason}; pass --tolerance to "
                             "compare the rerun's weights within a bound instead")
    config = _rerun_config(run)
    root = work_dir or storage.join(config.output_root, "reproduce")
    manifest, problems = check_data(run, storage.join(root, "converted"))
    versions = tuple(recorded.version_differences(run.versions, recorded.installed_distributions())
                     ) if run.versions else ()
    launcher = launchers.launcher_for(config)
    common = {"run_id": run_id, "tolerance": tolerance, "num_variables": len(run.weights),
              "version_differences": versions, "strategy": record.strategy, "num_workers": record.num_workers,
              "launcher": launcher.name, "export_step": record.export_step}
    if manifest is None:
        return ReproduceOutcome(reproduced=False, identical=False, differences={}, data_problems=tuple(problems),
                                run_dir=None, **common)
    run_dir = runs.run_dir_for(root, runs.new_run_name(f"{config.name}-reproduce"))
    logger.info("reproducing run %s: %s over %d worker(s), %d steps, on the %s launcher, into %s", run_id,
                record.strategy, record.num_workers, record.total_steps, launcher.name, run_dir)
    # Under the launcher the run was trained with (its recorded train.launcher and train.isolation): a Ray run
    # reruns on Ray.
    result = launcher.launch_training(config, manifest, run.plan, run_dir,
                                      options=launchers.LaunchOptions(log_fn=log_fn))
    checkpoint = next((c for c in result.checkpoints if c.step == record.export_step), None)
    if checkpoint is None:
        raise ReproduceError(
            f"the rerun kept no checkpoint at step {record.export_step}, the step run {run_id} exported (kept: "
            f"{[c.step for c in result.checkpoints]}); raise train.keep_checkpoints in the recorded config")
    weights = recorded.model_weights(restore_model(config, manifest, checkpoint))
    differences = compare_weights(run.weights, weights)
    identical = not differences
    reproduced = identical or (tolerance is not None and all(d <= tolerance for d in differences.values()))
    return ReproduceOutcome(reproduced=reproduced, identical=identical, differences=differences, data_problems=(),
                            run_dir=os.fspath(run_dir), **common)
