"""`tfdag predict` on the session's digits run (tests/flows/conftest.py): its export directory and its registered
champion score CSV, Parquet and JSON Lines chunk by chunk, in bounded memory, into Parquet or CSV; a bad row is one
line naming its file, line and column, or skipped and counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows import cli
from pipeline_lib.config import PredictConfig
from pipeline_lib.prediction import tables
from pipeline_lib.prediction.predict import predict
from pipeline_lib.serving.tfdag_scoring import Scorer
from tests.servers import ROOT

pytestmark = pytest.mark.slow  # the shared digits run trains once per session


@pytest.fixture(scope="module")
def digits(digits_run):
    """The digits rows as a table with an `id` column, and what the export's SavedModel predicts for them."""
    frame = pd.read_csv(digits_run.root / "raw" / "digits.csv").drop(columns=["target"])
    frame.insert(0, "id", np.arange(len(frame)) * 10)
    saved_model = os.path.join(digits_run.summary.export_dir, "saved_model")
    return frame, Scorer(saved_model).predict(frame)


def _assert_predictions(out: pd.DataFrame, frame: pd.DataFrame, expected: pd.DataFrame) -> None:
    assert list(out.columns) == ["id", "prediction", *(f"probability_{k}" for k in range(10))]
    np.testing.assert_array_equal(out["id"].to_numpy(), frame["id"].to_numpy())
    np.testing.assert_array_equal(out["prediction"].to_numpy(), expected["prediction"].to_numpy())
    np.testing.assert_allclose(out.filter(like="probability_").to_numpy(),
                               expected.filter(like="probability_").to_numpy(), rtol=1e-5, atol=1e-6)


def test_a_parquet_file_of_many_chunks_scores_like_one_call(digits_run, digits, tmp_path):
    frame, expected = digits
    source = tmp_path / "digits.parquet"
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), source, row_group_size=700)
    result = predict(PredictConfig(model=digits_run.summary.export_dir, input=str(source),
                                   output=str(tmp_path / "out" / "scored.parquet"), keep=("id",), batch_rows=256))
    # 1797 rows in row groups of 700, 700 and 397, each read 256 rows at a time: 3 + 3 + 2 chunks.
    assert (result.num_rows, result.num_skipped, result.num_chunks) == (len(frame), 0, 8)
    _assert_predictions(pd.read_parquet(tmp_path / "out" / "scored.parquet"), frame, expected)
    record = tables.read_metadata(str(tmp_path / "out" / "scored.parquet"))
    assert record["model"]["source"] == "export" and record["model"]["uri"] == digits_run.summary.export_dir
    export_manifest = json.loads((Path(digits_run.summary.export_dir) / "export_manifest.json").read_text())
    assert record["model"]["details"]["checkpoint_step"] == export_manifest["checkpoint"]["step"]
    assert (record["rows"], record["skipped_rows"], record["keep"]) == (len(frame), 0, ["id"])
    assert os.listdir(tmp_path / "out") == ["scored.parquet"]  # no temporary file left beside it


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_csv_and_json_lines_with_missing_cells_score_into_csv_with_a_sidecar(digits_run, digits, tmp_path, suffix):
    frame, _expected = digits
    frame = frame.iloc[:300].copy()
    frame.loc[[3, 150], "pixel_10"] = np.nan  # missing cells: imputed inside the model, as at training
    source = tmp_path / f"digits.{suffix}"
    if suffix == "csv":
        frame.to_csv(source, index=False)  # NaN is an empty cell
    else:
        frame.to_json(source, orient="records", lines=True)  # NaN is null
    output = tmp_path / "scored.csv"
    result = predict(PredictConfig(model=digits_run.summary.export_dir, input=str(source), output=str(output),
                                   keep=("id",), batch_rows=128))
    assert (result.num_rows, result.num_chunks, result.output_format.value) == (300, 3, "csv")
    scored = pd.read_csv(output)
    _assert_predictions(scored, frame, Scorer(os.path.join(digits_run.summary.export_dir, "saved_model"))
                        .predict(frame))
    assert not scored.filter(like="probability_").isna().any().any()
    assert tables.read_metadata(str(output))["rows"] == 300  # scored.csv.meta.json


def test_a_csv_that_converts_with_csv_options_scores_with_the_same_options(digits_run, digits, tmp_path):
    """No header row, ';' between fields, quotes around a kept note that holds line breaks, Latin-1 text: the
    data.csv_* options as `tfdag predict` flags, over chunks smaller than the file."""
    frame, expected = digits
    frame, expected = frame.iloc[:200].copy(), expected.iloc[:200]
    notes = frame.assign(note=[f"Zürich\nline {i}; \"quoted\"" for i in range(200)])
    source = tmp_path / "digits.csv"
    notes.to_csv(source, index=False, header=False, sep=";", encoding="latin-1")
    output = tmp_path / "scored.parquet"
    code = cli.main(["predict", digits_run.summary.export_dir, str(source), str(output), "--keep", "id",
                     "--keep", "note", "--batch-rows", "64", "--csv-delimiter", ";", "--csv-encoding", "latin-1",
                     "--csv-column-names", *notes.columns])
    assert code == 0
    scored = pd.read_parquet(output)
    assert scored["note"].tolist() == notes["note"].tolist()
    _assert_predictions(scored.drop(columns=["note"]).astype({"id": int}), frame, expected)  # kept CSV cells: text


# The one test here that starts a process: peak memory is a property of a whole process. ~20 s on 2 idle cores:
# TensorFlow's import and 320,000 rows scored.
def test_a_parquet_file_larger_than_the_memory_bound_scores_in_bounded_memory(digits_run, digits, tmp_path):
    frame, _expected = digits
    table = pa.Table.from_pandas(frame, preserve_index=False)
    sizes = {"small": 1, "medium": 40, "big": 140}  # the big file: 251,580 rows, 64 float64 columns
    for name, repeats in sizes.items():
        pq.write_table(pa.concat_tables([table] * repeats), tmp_path / f"{name}.parquet", row_group_size=16384)
    extra_mb = (sizes["big"] - sizes["medium"]) * frame.drop(columns=["id"]).memory_usage(index=False).sum() / 2**20
    script = textwrap.dedent(f"""
        import json, resource
        from flows.cli import main
        peaks = []
        for name in {list(sizes)!r}:
            code = main(["predict", {digits_run.summary.export_dir!r}, f"{tmp_path}/{{name}}.parquet",
                         f"{tmp_path}/{{name}}-scored.parquet", "--keep", "id", "--json"])
            assert code == 0, code
            peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print("PEAKS", json.dumps(peaks))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _small, medium_peak, big_peak = json.loads(out.stdout.split("PEAKS", 1)[1])
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    rows = len(frame) * sizes["big"]
    assert result["num_rows"] == rows and result["num_chunks"] >= rows / 4096
    assert pq.read_metadata(tmp_path / "big-scored.parquet").num_rows == rows
    # The first runs warm the allocators up; after them, 3.5 times the rows (88 MB more once decoded) raise the peak
    # by a few MB: what is held is a few chunks of 4096 rows and two row groups, not the file (measured: 7 MB).
    assert big_peak - medium_peak < extra_mb / 4, (medium_peak, big_peak, extra_mb)


def test_a_bad_row_is_one_line_naming_file_line_and_column_and_nothing_is_written(digits_run, digits, tmp_path,
                                                                                   capsys):
    frame, _expected = digits
    lines = frame.iloc[:50].to_csv(index=False).splitlines()
    cells = lines[8].split(",")
    cells[frame.columns.get_loc("pixel_5")] = "seven"
    lines[8] = ",".join(cells)  # line 9 of the file: the header is line 1
    source = tmp_path / "bad.csv"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out" / "scored.parquet"

    code = cli.main(["predict", digits_run.summary.export_dir, str(source), str(output), "--keep", "id",
                     "--batch-rows", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"tfdag: bad record: {source} line 9, column 'pixel_5': value 'seven' is not a number")
    assert "--on-bad-record skip" in err[-1] and not any("Traceback" in line for line in err)
    assert not output.parent.exists() or os.listdir(output.parent) == []  # not even a temporary file

    code = cli.main(["predict", digits_run.summary.export_dir, str(source), str(output), "--keep", "id",
                     "--batch-rows", "16", "--on-bad-record", "skip", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert (result["num_rows"], result["num_skipped"]) == (49, 1)
    assert result["bad_samples"] == [f"{source} line 9, column 'pixel_5': value 'seven' is not a number"]
    scored = pd.read_parquet(output)
    assert 70 not in scored["id"].tolist() and len(scored) == 49  # line 9 (id 70) skipped, the others scored
    record = tables.read_metadata(str(output))
    assert (record["skipped_rows"], record["bad_samples"]) == (1, result["bad_samples"])


def test_a_registered_version_and_a_runs_uri_score_and_the_model_is_recorded(digits_run, digits, tmp_path):
    """On the run's sqlite store, named only by tracking_uri (the training pipeline moves no alias: `@champion` is the
    deployment test's, tests/flows/test_batch_predict.py)."""
    frame, expected = digits
    summary = digits_run.summary
    source = tmp_path / "digits.parquet"
    pq.write_table(pa.Table.from_pandas(frame.iloc[:500], preserve_index=False), source)
    version = int(summary.model_version)
    for uri, name in ((f"models:/{summary.model_name}/{version}", summary.model_name),
                      (f"runs:/{summary.mlflow_run_id}/model", None)):
        output = tmp_path / f"{'version' if name else 'run'}.parquet"
        result = predict(PredictConfig(model=uri, input=str(source), output=str(output), keep=("id",),
                                       tracking_uri=summary.mlflow_uri))
        assert (result.model.source, result.model.run_id) == ("mlflow", summary.mlflow_run_id)
        assert result.model.model_id.startswith("m-")
        _assert_predictions(pd.read_parquet(output), frame.iloc[:500], expected.iloc[:500])
        recorded = tables.read_metadata(str(output))["model"]
        assert (recorded["uri"], recorded["name"], recorded["version"], recorded["run_id"]) == (
            uri, name, version if name else None, summary.mlflow_run_id)


def test_an_unknown_model_or_a_missing_store_is_one_line(digits_run, tmp_path):
    from pipeline_lib.prediction.models import PredictionError

    source = tmp_path / "rows.csv"
    source.write_text("pixel_0\n1.0\n")
    config = {"input": str(source), "output": str(tmp_path / "out.parquet"),
              "tracking_uri": digits_run.summary.mlflow_uri}
    with pytest.raises(PredictionError, match=r"models:/no-such-model@champion' is not in the MLflow store"):
        predict(PredictConfig(model="models:/no-such-model@champion", **config))
    with pytest.raises(PredictionError, match="neither an export directory"):
        predict(PredictConfig(model=str(tmp_path), **config))
    with pytest.raises(PredictionError, match="has no column 'pixel_1'"):
        predict(PredictConfig(model=digits_run.summary.export_dir, **config))
    assert not (tmp_path / "out.parquet").exists()
