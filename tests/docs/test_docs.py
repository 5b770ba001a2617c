"""The docs (docs/ and the README): the site builds in strict mode, every `tfdag` command in a bash block parses with
the CLI's own parser, every YAML block is a config the schema takes, the performance table is results.json's, the
model factory of "Your own model" builds, and the getting-started tutorial runs end to end."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from flows.cli import build_parser
from pipeline_lib.config import parse_config
from pipeline_lib.config.json_schema import config_schema

PROJECT = Path(__file__).resolve().parents[2]
PAGES = sorted([PROJECT / "README.md", *(PROJECT / "docs").rglob("*.md")])
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
VENV_BIN = Path(sys.executable).parent


def blocks(language: str, pages=PAGES) -> list[tuple[str, str]]:
    """(page, block text) of every fenced block of `language`."""
    return [(str(page.relative_to(PROJECT)), m.group(2)) for page in pages
            for m in BLOCK.finditer(page.read_text()) if m.group(1) == language]


def commands(text: str) -> list[str]:
    """The shell lines of a block, continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and
             not line.lstrip().startswith("#")]
    return [part.strip() for line in lines for part in line.split(" && ")]


def tfdag_argv(line: str) -> list[str] | None:
    if os.path.basename(line.split(" ", 1)[0]) != "tfdag":
        return None
    words = shlex.split(line, comments=True)
    if words and os.path.basename(words[0]) == "tfdag":
        return words[1:]
    return None


def test_the_site_builds_in_strict_mode(tmp_path):
    """A broken link, anchor or page fails the build; the CLI and config references are generated first."""
    subprocess.run([sys.executable, "docs/generate.py"], cwd=PROJECT, check=True, capture_output=True)
    built = subprocess.run([str(VENV_BIN / "mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=PROJECT, capture_output=True, text=True, check=False,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "data.engine" in config_page and "train.per_replica_batch_size" in config_page
    assert "tfdag init" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def test_every_tfdag_command_in_the_docs_parses():
    parser = build_parser()
    checked = []
    for page, text in blocks("bash"):
        for line in commands(text):
            argv = tfdag_argv(line)
            if argv is None:
                continue
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{page}: `{line}` does not parse with tfdag's parser")
            checked.append(line)
    assert len(checked) > 15, checked


def test_every_yaml_block_is_a_config_the_schema_and_the_models_take():
    """```yaml is a tfdag config, checked in full; another program's YAML is fenced ```yml."""
    validator = jsonschema.Draft202012Validator(config_schema())
    found = blocks("yaml")
    assert len(found) >= 4
    for page, text in found:
        document = yaml.safe_load(text)
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, f"{page}: {errors}"
        parse_config(document)


def test_the_performance_table_is_the_one_results_json_gives():
    from bench import table

    results = json.loads((PROJECT / "bench" / "results.json").read_text())
    page = (PROJECT / "docs" / "performance.md").read_text()
    assert f"{table.START}\n{table.table(results)}\n{table.END}" in page, (
        "docs/performance.md is stale: `python -m bench.table --write`")


def test_the_model_factory_of_your_own_model_builds_a_model(tmp_path, monkeypatch):
    from pipeline_lib.config import ModelConfig
    from pipeline_lib.data.convert import convert
    from pipeline_lib.data.statistics import load_statistics
    from pipeline_lib.training.models import create_model

    (source,) = [text for page, text in blocks("python") if page.endswith("own-model.md")]
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = ["x,kind,target", *(f"{i * 0.5},{'ab'[i % 2]},{i % 3}" for i in range(60))]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    config = parse_config({"name": "t", "data": {"source": str(tmp_path / "t.csv"), "label": "target"},
                           "output_root": str(tmp_path / "out")})
    manifest = convert(config.data, config.output_root)
    model = create_model(ModelConfig(factory="mypkg.models:wide_and_deep", params={"units": 8}),
                         manifest.feature_schema, load_statistics(manifest))
    assert model.output_shape == (None, 3)


@pytest.mark.slow
def test_the_getting_started_tutorial_runs_end_to_end(prefect_api, tmp_path):
    """The tutorial's commands as written, in a fresh directory, against the session's Prefect server: a table of
    one's own to a registered champion and a scored table."""
    page = PROJECT / "docs" / "getting-started.md"
    text = page.read_text()
    tutorial = text[text.index("## Tutorial: your own table"):]
    (block,) = [m.group(2) for m in BLOCK.finditer(tutorial)][:1]
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_API_URL": prefect_api,
           "PYTHONPATH": str(PROJECT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    outputs = []
    for line in commands(block):
        line = line.replace(".venv/bin/", f"{VENV_BIN}/")
        done = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        assert done.returncode == 0, f"`{line}` exited {done.returncode}: {done.stderr[-3000:]}"
        outputs.append(done.stdout)
    summary = json.loads(outputs[2].strip().splitlines()[-1])
    assert summary["blessed"] and summary["model_version"] == "1", summary
    import pandas as pd

    scored = pd.read_parquet(tmp_path / "scored.parquet")
    assert len(scored) == 178 and (scored["prediction"].astype(str) == scored["target"].astype(str)).mean() > 0.8
