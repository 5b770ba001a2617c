"""The stage commands: `tfdag convert`, `plan`, `validate-data`, `train` and `evaluate`, each one stage alone, no
Prefect, every one starting from `stage_inputs` (the one path config → manifest → plan)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_convert(args: argparse.Namespace) -> int:
    from flows.stage_inputs import stage_inputs
    from pipeline_lib.core.exit_codes import EXIT_OK

    manifest = stage_inputs(args.config).manifest
    print(json.dumps({
        "dataset_uri": manifest.dataset_uri,
        "fingerprint": manifest.fingerprint,
        "train_records": manifest.num_records("train"),
        "eval_records": manifest.num_records("eval"),
        "shards": len(manifest.shards),
        "bad_records": manifest.num_bad_records,
        "engine": manifest.engine,
        "nodes": manifest.nodes or {"local": len(manifest.shards)},
    }, indent=2))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from flows.stage_inputs import stage_inputs
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.planning import sharding

    print(sharding.plan_to_markdown(stage_inputs(args.config).plan(num_workers=args.workers)))
    return EXIT_OK


def cmd_validate_data(args: argparse.Namespace) -> int:
    """Convert (or reuse) the data and check it against the baseline: exit 0 without anomalies, 2 with, one per line."""
    from flows.stage_inputs import stage_inputs
    from pipeline_lib.core.exit_codes import EXIT_BAD_INPUT, EXIT_OK
    from pipeline_lib.data.statistics import load_statistics
    from pipeline_lib.tracking.data_check import check_data

    inputs = stage_inputs(args.config)
    config, manifest = inputs.config, inputs.manifest
    report = check_data(config, manifest.feature_schema, load_statistics(manifest, config.storage_options),
                        against=args.against)
    for anomaly in report.anomalies:
        print(anomaly.describe())
    print(f"tfdag | data validation against {report.baseline}: {len(report.anomalies)} anomalies, "
          f"{len(report.blocking)} not allowed", file=sys.stderr)
    return EXIT_BAD_INPUT if report.blocking else EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from flows.stage_inputs import stage_inputs
    from pipeline_lib.core import runs
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.data.statistics import load_statistics
    from pipeline_lib.data.validation import check_label
    from pipeline_lib.launch import launchers as launcher

    inputs = stage_inputs(args.config)
    config, manifest = inputs.config, inputs.manifest
    check_label(manifest.feature_schema, load_statistics(manifest, config.storage_options), config.model.task)
    plan = inputs.plan()
    run_dir = runs.run_dir_for(config.output_root, runs.new_run_name(config.name))
    result = launcher.launch_training(config, manifest, plan, run_dir)
    print(result.model_dump_json(indent=2))
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    from flows.stage_inputs import stage_inputs
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.evaluation import metrics as evaluation
    from pipeline_lib.evaluation.gate import apply_gate

    inputs = stage_inputs(args.config)
    config = inputs.config
    report = evaluation.evaluate(config, inputs.manifest, args.model)
    report = report.model_copy(update={"gate": apply_gate(report, config.evaluation.gate)})  # no champion here
    print(report.to_markdown())
    return EXIT_OK
