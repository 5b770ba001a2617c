"""`tfdag predict MODEL INPUT OUTPUT`: batch scoring from the command line, without Prefect."""

from __future__ import annotations

import argparse
import json
import os

HELP = ("score a table (CSV, Parquet, JSON Lines; any fsspec URL) with a model (models:/NAME@ALIAS, models:/NAME/N, "
        "runs:/ID/model or an export directory) into Parquet or CSV, chunk by chunk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/model, or an export directory "
                                 "(a run's export_dir: saved_model/ and export_manifest.json)")
    p.add_argument("input", help="the table: a file, directory or glob of .csv, .parquet or .jsonl (any fsspec URL)")
    p.add_argument("output", help="where the predictions go: .parquet or .csv (any fsspec URL), written whole or not "
                                  "at all")
    p.add_argument("--keep", action="append", default=[], metavar="COLUMN",
                   help="copy this input column to the output beside the predictions (repeat for more), e.g. an id")
    p.add_argument("--format", dest="output_format", choices=["parquet", "csv"], default=None,
                   help="the output's format (default: by OUTPUT's extension)")
    p.add_argument("--input-format", choices=["auto", "csv", "parquet", "jsonl"], default="auto",
                   help="the input's format (default: by extension)")
    p.add_argument("--batch-rows", type=int, default=None,
                   help="rows per chunk and per call of the model: what bounds memory (default 4096)")
    p.add_argument("--on-bad-record", choices=["fail", "skip"], default="fail",
                   help="fail: stop at the first bad row, naming its file, line and column (exit 2); skip: score the "
                        "others and count the bad ones (default: fail)")
    p.add_argument("--csv-delimiter", default=None, metavar="CHAR",
                   help="a CSV input's delimiter, as the config's data.csv_delimiter (default ',')")
    p.add_argument("--csv-quote-char", default=None, metavar="CHAR",
                   help="a CSV input's quote character, or 'none' for a CSV without quoting (default '\"')")
    p.add_argument("--csv-column-names", nargs="+", default=None, metavar="NAME",
                   help="the column names of a CSV input without a header row (its first line is data)")
    p.add_argument("--csv-encoding", default=None, metavar="NAME",
                   help="a CSV input's encoding: utf-8, latin-1 or cp1252 (default utf-8)")
    p.add_argument("--tracking-uri", default=None,
                   help="the MLflow store of a models:/ or runs:/ URI (default: $MLFLOW_TRACKING_URI, else the "
                        "bundled config's)")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: score in this process into one file; ray: score the input's files and row groups on "
                        "a Ray cluster into a directory of parts with a marker written last (default: local)")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="--engine ray: the Ray head's address (default: $RAY_ADDRESS)")
    p.add_argument("--ray-actors", type=int, default=None, metavar="N",
                   help="--engine ray: scoring actors, each holding the model (default: as many as the cluster holds)")
    p.add_argument("--ray-resources", default=None, metavar="JSON",
                   help="--engine ray: what each actor asks of a node, e.g. '{\"CPU\": 1, \"GPU\": 1}' "
                        "(default: one CPU)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def predict_config(args: argparse.Namespace):
    """The PredictConfig the arguments describe; an invalid one is a ConfigError naming the option."""
    from pydantic import ValidationError

    from flows.flow_config import load
    from pipeline_lib.config import ConfigError, PredictConfig
    from pipeline_lib.prediction.models import is_mlflow_uri

    tracking_uri = args.tracking_uri
    if tracking_uri is None and is_mlflow_uri(args.model):
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or load(None).mlflow_uri
    values = {"model": args.model, "input": args.input, "output": args.output, "keep": tuple(args.keep),
              "output_format": args.output_format, "input_format": args.input_format,
              "on_bad_record": args.on_bad_record, "tracking_uri": tracking_uri}
    if args.batch_rows is not None:
        values["batch_rows"] = args.batch_rows
    if args.engine == "ray":
        values["engine"] = "ray"
        ray = {"address": args.ray_address, "actors": args.ray_actors}
        if args.ray_resources is not None:
            try:
                ray["resources_per_actor"] = json.loads(args.ray_resources)
            except json.JSONDecodeError as error:
                raise ConfigError(f"--ray-resources ({args.ray_resources!r}) is not JSON ({error}); give an object "
                                  "such as '{\"CPU\": 1}'") from None
        values["ray"] = ray
    # The CSV options a conversion takes (data.csv_*), so that a table that converts can be scored.
    csv_options = {"csv_delimiter": args.csv_delimiter, "csv_encoding": args.csv_encoding,
                   "csv_column_names": tuple(args.csv_column_names) if args.csv_column_names else None,
                   "csv_quote_char": None if args.csv_quote_char == "none" else args.csv_quote_char}
    values.update({name: value for name, value in csv_options.items()
                   if value is not None or (name == "csv_quote_char" and args.csv_quote_char == "none")})
    try:
        return PredictConfig(**values)
    except ValidationError as error:
        problem = error.errors()[0]
        location = [str(part) for part in problem["loc"]]
        option = "--" + "-".join(location[:2] if location[0] == "ray" else location[:1]).replace("_", "-")
        raise ConfigError(f"{option} ({problem.get('input')!r}): {problem['msg']}") from None


def cmd_predict(args: argparse.Namespace) -> int:
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.prediction.predict import predict

    result = predict(predict_config(args))
    print(f"tfdag | {result.summary_line()}", flush=True)
    if args.json:
        print(result.model_dump_json())
    return EXIT_OK
