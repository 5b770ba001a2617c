"""Writes the generated pages of the docs site (`make docs` runs it before `mkdocs build --strict`):

- reference/cli.md: every `tfdag` command and option, from the CLI's own argparse parser;
- reference/config.md: every config key with its dotted path, type, default and description, from the models.

(performance.md's table is written from bench/results.json by `python -m bench.table --write`.)

The generated files are not committed (.gitignore): the code is their one source.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

DOCS = Path(__file__).resolve().parent
PROJECT = DOCS.parent
sys.path.insert(0, str(PROJECT))


def cli_page() -> str:
    from flows.cli import build_parser

    parser = build_parser()
    lines = ["# The `tfdag` command line", "",
             "Generated from the CLI's own parser. `tfdag COMMAND --help` prints the same.", ""]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        lines += [f"## `tfdag {name}`", "", sub.description or "", "", "```text", sub.format_usage().strip(), "```", ""]
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(action.option_strings) or action.dest
            default = "" if action.default in (None, False, argparse.SUPPRESS) or action.required else action.default
            rows.append(f"| `{flag}` | {_cell(action.help or '')} | {_cell(str(default)) if default != '' else ''} |")
        if rows:
            lines += ["| argument | meaning | default |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    if text is None:
        text = str(annotation).replace("typing.", "").replace("pipeline_lib.config.", "")
    for module in ("base.", "data.", "train.", "ray.", "run.", "tune.", "evaluation.", "csv.", "predict."):
        text = text.replace(module, "")
    return text


def config_page() -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from pipeline_lib.config import PipelineConfig

    intro = ("Every key of a pipeline YAML file, generated from the config's models: its dotted path, type, default "
             "and description. Unknown keys are refused, naming the key and the file. Editors complete and check "
             "the keys with the committed JSON Schema (`tfdag schema`); each example config names it on its first "
             "line.")
    lines = ["# Config reference", "", intro, ""]
    seen: set[type] = set()

    def section(model: type[BaseModel], prefix: str, title: str) -> None:
        rows, nested = [], []
        for name, field in model.model_fields.items():
            key = field.alias or name
            default = field.default
            if field.default_factory is not None:
                default = field.default_factory()
            shown = "required" if default is PydanticUndefined else f"`{json.dumps(default, default=str)}`"
            if isinstance(default, BaseModel):
                shown = "(section)"
            rows.append(f"| `{prefix}{key}` | `{_cell(_type_name(field.annotation))}` | {_cell(shown)} | "
                        f"{_cell(field.description or '')} |")
            for candidate in [field.annotation, *typing.get_args(field.annotation)]:
                for kind in [candidate, *typing.get_args(candidate)]:
                    if isinstance(kind, type) and issubclass(kind, BaseModel) and kind not in seen:
                        seen.add(kind)
                        nested.append((kind, f"{prefix}{key}." if kind.__name__ != "ColumnMissingConfig"
                                       else f"{prefix}{key}.<column>.", f"{prefix}{key}"))
        lines.extend([f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|", *rows, ""])
        for kind, sub_prefix, sub_title in nested:
            section(kind, sub_prefix, f"`{sub_title}`")

    section(PipelineConfig, "", "Top level")
    return "\n".join(lines)


def main() -> int:
    (DOCS / "reference").mkdir(exist_ok=True)
    (DOCS / "reference" / "cli.md").write_text(cli_page())
    (DOCS / "reference" / "config.md").write_text(config_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
