"""`tfdag init DATA_URI --label COL`: a config written from a table's first rows, the task and the features decided
with their reasons, and clear refusals (tests/docs runs the tutorial: the written config trained and registered as it is)."""

from __future__ import annotations

import random
from pathlib import Path

import jsonschema
import pytest
import yaml

from flows.cli import main
from pipeline_lib.config import Task, load_config
from pipeline_lib.config.json_schema import config_schema


@pytest.fixture
def houses(tmp_path) -> str:
    rng = random.Random(1)
    lines = ["house_id,rooms,area,city,note,year_built,species"]
    for i in range(400):
        words = " ".join(rng.choice(["nice", "garden", "view", "quiet", "old", "bright"]) for _ in range(8))
        lines.append(f"{1000 + i},{rng.randint(1, 6)},{rng.uniform(30, 200):.1f},{rng.choice(['Turin', 'Asti'])},"
                     f"\"{words} #{i}\",{rng.randint(1900, 2020)},{rng.choice(['oak', 'elm', 'ash'])}")
    path = tmp_path / "houses.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_year_label_is_a_regression_and_identifiers_and_free_text_are_left_out(houses, tmp_path, capsys):
    written = tmp_path / "configs" / "houses.yaml"
    assert main(["init", houses, "--label", "year_built", "-o", str(written)]) == 0
    said = capsys.readouterr().err
    years = {line.rsplit(",", 2)[1] for line in Path(houses).read_text().splitlines()[1:]}
    assert f"task: regression ('year_built' holds {len(years)} distinct integers" in said, said
    assert "left out 'house_id': an identifier" in said and "left out 'note': free text" in said
    assert "text columns (categories, or left out below): city, note, species" in said
    text = written.read_text()
    assert text.startswith("# yaml-language-server: $schema=../../")
    jsonschema.Draft202012Validator(config_schema()).validate(yaml.safe_load(text))
    config = load_config(str(written))
    assert config.model.task == Task.REGRESSION and config.data.source == houses
    assert config.tracking.registered_model == config.name == "houses"
    assert config.data.features == ("rooms", "area", "city", "species")
    assert "#   house_id: an identifier" in text and "#   note: free text" in text


def test_a_text_label_is_a_classification_naming_its_values(houses, capsys):
    assert main(["init", houses, "--label", "species"]) == 0
    out, said = capsys.readouterr()
    assert "label values seen: ash, elm, oak" in said and "task: classification" in said
    config = yaml.safe_load(out)
    assert config["model"]["task"] == "classification" and config["data"]["label"] == "species"


def test_an_unknown_label_lists_the_columns_and_an_existing_file_is_kept(houses, tmp_path, capsys):
    assert main(["init", houses, "--label", "colour"]) == 2
    said = capsys.readouterr().err
    assert "--label 'colour' is not a column of" in said and "'house_id', 'rooms', 'area'" in said, said
    kept = tmp_path / "mine.yaml"
    kept.write_text("name: mine\n")
    assert main(["init", houses, "--label", "rooms", "-o", str(kept)]) == 2
    assert "exists; choose another file, or pass --force" in capsys.readouterr().err
    assert kept.read_text() == "name: mine\n"
