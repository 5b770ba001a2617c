"""`tfdag init DATA_URI --label COL [-o FILE]`: a commented config for a table, written from a look at its first rows."""

from __future__ import annotations

import argparse
import os
import re
import sys

HELP = "write a commented config for your table: the task, the features and what was left out, with the reasons"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data_uri", help="the table: a file, directory or glob of CSV, Parquet, JSON Lines or NPZ (any "
                                    "fsspec URL)")
    p.add_argument("--label", required=True, help="the column the model predicts")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write the config here (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")


def _name(uri: str) -> str:
    stem = os.path.basename(uri.rstrip("/").split("*")[0].rstrip("/")) or "table"
    stem = stem.split(".")[0]
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "table"


def render(profile, schema_ref: str) -> str:
    """The config's YAML text, every decision commented with its reason."""
    from pipeline_lib.config.json_schema import modeline

    lines = [modeline(schema_ref),
             f"# Written by `tfdag init` from the first {profile.sample_rows} rows of {profile.sample_file}.",
             "# Edit freely: `tfdag schema` describes every key, and the README's defaults apply to the keys left out.",
             f"name: {_name(profile.source)}",
             "data:",
             f"  source: {_quoted(profile.source)}",
             f"  label: {_quoted(profile.label)}"]
    if profile.left_out:
        lines.append("  # Left out of the features:")
        lines += [f"  #   {name}: {why}" for name, why in profile.left_out.items()]
        lines.append(f"  features: [{', '.join(_quoted(name) for name in profile.features)}]")
    else:
        lines.append(f"  # Features: every other column ({', '.join(profile.features)})")
    lines += ["model:", f"  # {profile.task_reason}"]
    if profile.label_values:
        lines.append(f"  # label values seen: {', '.join(map(str, profile.label_values))}")
    lines.append(f"  task: {profile.task.value}")
    name = _name(profile.source)
    lines += ["tracking:", f"  experiment: {name}",
              f"  # a blessed model is registered under this name: models:/{name}/1 is the first version",
              f"  registered_model: {name}"]
    return "\n".join(lines) + "\n"


def _quoted(value: str) -> str:
    import json

    return value if re.fullmatch(r"[A-Za-z0-9_./:*-]+", value) and not value[0].isdigit() else json.dumps(value)


def cmd_init(args: argparse.Namespace) -> int:
    from pipeline_lib.config import ConfigError, load_config
    from pipeline_lib.config.json_schema import SCHEMA_PATH
    from pipeline_lib.core.exit_codes import EXIT_OK
    from pipeline_lib.data.profile import profile_table

    if args.output and os.path.exists(args.output) and not args.force:
        raise ConfigError(f"-o {args.output!r} exists; choose another file, or pass --force to overwrite it")
    source = args.data_uri if "://" in args.data_uri else os.path.abspath(args.data_uri)  # from any directory
    profile = profile_table(source, args.label)
    if args.output:
        reference = os.path.relpath(SCHEMA_PATH, os.path.dirname(os.path.abspath(args.output)))
    else:
        reference = str(SCHEMA_PATH)
    text = render(profile, reference)
    say = (lambda line: print(f"tfdag init | {line}", file=sys.stderr))
    say(f"task: {profile.task.value} ({profile.task_reason})")
    if profile.label_values:
        say(f"label values seen: {', '.join(map(str, profile.label_values))}")
    text_columns = [n for n, t in profile.types.items() if t.startswith("string") and n != profile.label]
    if text_columns:
        say(f"text columns (categories, or left out below): {', '.join(text_columns)}")
    for name, why in profile.left_out.items():
        say(f"left out {name!r}: {why}")
    if not args.output:
        sys.stdout.write(text)
        return EXIT_OK
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(text)
    load_config(args.output)  # what it wrote loads as it is
    say(f"wrote {args.output}; train it with `tfdag run {args.output}`")
    return EXIT_OK
