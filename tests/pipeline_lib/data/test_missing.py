"""Tests for pipeline_lib.data.missing: impute (the default), skip and fail, per column; the fill values."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline_lib.config import ConfigError, DataConfig, parse_config
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.statistics import MISSING_INT64, load_statistics
from pipeline_lib.training import input_pipeline
from tests.pipeline_lib.data.conversion_support import read_all

ROWS = ["id,count,size,color,y",
        "1,3,1.5,red,0", "2,,2.5,blue,1", "3,5,,red,0", "4,7,4.5,,1", "5,9,10.0,green,0", "6,11,,blue,1"]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "holes.csv"
    path.write_text("\n".join(ROWS) + "\n")
    return str(path)


def _everything(manifest):
    rows = {k: np.concatenate([read_all(manifest, "train")[k], read_all(manifest, "eval")[k]])
            for k in ("id", "count", "size", "color")}
    order = np.argsort(rows["id"])
    return {k: v[order] for k, v in rows.items()}


def test_by_default_missing_features_are_written_missing_and_counted(source, tmp_path):
    manifest = convert(DataConfig(source=source, label="y"), str(tmp_path / "out"))
    assert manifest.num_bad_records == 0
    rows = _everything(manifest)
    assert rows["count"].tolist() == [3, MISSING_INT64, 5, 7, 9, 11]
    assert np.isnan(rows["size"]).tolist() == [False, False, True, False, False, True]
    assert rows["color"].tolist() == [b"red", b"blue", b"red", b"", b"green", b"blue"]
    merged = {name: sum(load_statistics(manifest).feature(name, split).missing for split in ("train", "eval"))
              for name in ("count", "size", "color")}
    assert merged == {"count": 1, "size": 2, "color": 1}
    # The input pipeline gives the model NaN for a missing int64 as for a missing float.
    numeric = np.concatenate([inputs["numeric"].numpy() for inputs, _ in
                              input_pipeline.create_dataset(manifest, "train", 8)]
                             + [inputs["numeric"].numpy() for inputs, _ in
                                input_pipeline.create_dataset(manifest, "eval", 8)])
    assert int(np.isnan(numeric).sum()) == 3


def test_fill_values_come_from_the_train_split_as_configured_per_column(source, tmp_path):
    data = DataConfig(source=source, label="y", split={"eval_fraction": 0.01},  # every row in train
                      missing_columns={"size": {"impute_with": "median", "missing_indicator": True},
                                       "id": {"impute_with": "constant", "impute_value": -1}})
    manifest = convert(data, str(tmp_path / "out"))
    assert manifest.num_records("eval") == 0
    imputation = load_statistics(manifest).imputation
    assert imputation["count"].fill_value == pytest.approx(np.mean([3, 5, 7, 9, 11]))
    assert not imputation["count"].indicator
    # The lower median of 1.5, 2.5, 4.5 and 10.0, within a sketch bucket.
    assert imputation["size"].fill_value == pytest.approx(2.5, rel=0.04) and imputation["size"].indicator
    assert imputation["id"].fill_value == -1
    assert "color" not in imputation  # strings: out-of-vocabulary in the model


def test_skip_and_fail_per_column(source, tmp_path):
    skip_size = DataConfig(source=source, label="y", missing_columns={"size": {"missing": "skip"}})
    manifest = convert(skip_size, str(tmp_path / "skip"))
    assert manifest.num_bad_records == 2  # the rows without a size; the others are imputed
    assert sorted(_everything(manifest)["id"].tolist()) == [1, 2, 4, 5]
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=source, label="y", missing="fail"), str(tmp_path / "fail"))
    message = str(error.value)
    assert "holes.csv line 3, column 'count'" in message and "is missing" in message
    assert "data.missing" in message
    with pytest.raises(ConversionError, match=r"line 5, column 'color'"):  # an empty string is missing too
        convert(DataConfig(source=source, label="y", missing_columns={"color": {"missing": "fail"}}),
                str(tmp_path / "fail-color"))


def test_missing_columns_must_name_features(source, tmp_path):
    with pytest.raises(ConversionError, match=r"data.missing_columns names \['colour'\]"):
        convert(DataConfig(source=source, label="y", missing_columns={"colour": {"missing": "skip"}}),
                str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"missing_columns names the label 'y'"):
        parse_config({"data": {"source": source, "label": "y", "missing_columns": {"y": {"missing": "skip"}}}})


def test_a_missing_label_in_a_row_skipped_for_a_missing_feature_still_fails(tmp_path):
    path = tmp_path / "both.csv"
    path.write_text("a,b,y\n1.0,2.0,0\n,3.0,\n4.0,5.0,1\n")
    with pytest.raises(ConversionError, match=r"both.csv line 3, column"):
        convert(DataConfig(source=str(path), label="y", missing="skip"), str(tmp_path / "out"))
    manifest = convert(DataConfig(source=str(path), label="y", missing="skip", on_bad_record="skip"),
                       str(tmp_path / "skip"))
    assert manifest.num_bad_records == 1
