"""`tfdag predict --engine ray` on the test's Ray cluster (tests/ray/conftest.py): a directory of parts with the local
engine's rows and predictions and a marker written last, a bad row named with its file, line and node, and a node
SIGKILLed mid-scoring whose part is scored again, not twice; input and output on moto's S3."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pandas as pd
import pytest

from pipeline_lib.config import DataEngine, PredictConfig, RayScoring, parse_config
from pipeline_lib.data.convert import convert
from pipeline_lib.evaluation import consolidation
from pipeline_lib.planning import sharding
from pipeline_lib.prediction import tables
from pipeline_lib.prediction.models import PredictionError
from pipeline_lib.prediction.predict import predict
from pipeline_lib.training import loop as training
from tests.ray.conftest import RAY_IP
from tests.ray.tables_support import lose_the_node_mid_way, write_csvs
from tests.stores.conftest import BUCKET


@pytest.fixture(scope="module")
def species_model(tmp_path_factory) -> str:
    """An export of a small model of the species table, trained a few steps in this process."""
    root = tmp_path_factory.mktemp("species")
    source = write_csvs(root / "train", files=1, rows=600)
    config = parse_config({"name": "species", "data": {"source": source, "label": "species"},
                           "output_root": str(root / "out"), "train": {"steps": 4},
                           "tracking": {"enabled": False}, "preflight": {"enabled": False}})
    manifest = convert(config.data, config.output_root)
    result = training.train(config, manifest, sharding.plan_for_train(manifest, config.train, 1), str(root / "run"))
    return consolidation.consolidate(config, manifest, result, str(root / "run" / "export")).export_dir


def _parts(output: str) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(part) for part in sorted(glob.glob(os.path.join(output, "part-*.parquet")))],
                     ignore_index=True)


def _same_predictions(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    np.testing.assert_array_equal(got["n"].to_numpy(), want["n"].to_numpy())
    np.testing.assert_array_equal(got["prediction"].to_numpy(), want["prediction"].to_numpy())
    np.testing.assert_allclose(got.filter(like="probability_").to_numpy(),
                               want.filter(like="probability_").to_numpy(), rtol=1e-5, atol=1e-6)


def test_scoring_on_ray_writes_the_local_rows_and_predictions_as_parts_with_a_marker(ray_cluster, species_model,
                                                                                      tmp_path, capsys):
    from flows.cli import main

    source = write_csvs(tmp_path / "src", files=3, rows=700)
    local = predict(PredictConfig(model=species_model, input=source, output=str(tmp_path / "local.parquet"),
                                  keep=("n",), batch_rows=256))
    output = str(tmp_path / "scored.parquet")
    assert main(["predict", species_model, source, output, "--engine", "ray", "--ray-address", ray_cluster.address,
                 "--keep", "n", "--batch-rows", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["engine"] == "ray" and result["num_rows"] == local.num_rows == 2100
    assert sum(result["nodes"].values()) == 3 and all(n.endswith(f"({RAY_IP})") for n in result["nodes"])
    _same_predictions(_parts(output), pd.read_parquet(tmp_path / "local.parquet"))
    record = tables.read_metadata(output)
    assert (record["rows"], record["skipped_rows"], record["keep"], record["engine"]) == (2100, 0, ["n"], "ray")
    assert [p["path"] for p in record["parts"]] == [f"part-{i:05d}.parquet" for i in range(3)]
    assert sorted(os.listdir(output)) == sorted([*(f"part-{i:05d}.parquet" for i in range(3)), tables.PARTS_MARKER])


def test_a_bad_row_on_a_node_is_named_with_its_file_line_and_node_and_nothing_is_left(ray_cluster, species_model,
                                                                                      tmp_path):
    source = write_csvs(tmp_path / "src", files=2, rows=100, bad={1: 57})
    output = tmp_path / "scored.parquet"
    with pytest.raises(PredictionError) as raised:
        predict(PredictConfig(model=species_model, input=source, output=str(output), engine=DataEngine.RAY,
                              ray=RayScoring(address=ray_cluster.address, node_ip_address=RAY_IP)))
    message = str(raised.value)
    assert f"{tmp_path / 'src' / 'part1.csv'} line 57, column 'x'" in message and "'abc'" in message, message
    assert "on Ray node" in message and f"({RAY_IP})" in message
    assert not output.exists()


def test_a_node_killed_mid_scoring_has_its_part_scored_again_not_twice(ray_cluster, species_model, tmp_path):
    source = write_csvs(tmp_path / "src", files=6, rows=3000)
    local = predict(PredictConfig(model=species_model, input=source, output=str(tmp_path / "local.parquet"),
                                  keep=("n",), batch_rows=100))
    output = tmp_path / "scored.parquet"

    def score(resources: dict[str, float]):
        return predict(PredictConfig(model=species_model, input=source, output=str(output), keep=("n",),
                                     batch_rows=100, engine=DataEngine.RAY,
                                     ray=RayScoring(address=ray_cluster.address, node_ip_address=RAY_IP,
                                                    resources_per_actor=resources)))

    def scoring() -> bool:  # a part being written: the only node the actor fits on is scoring
        return output.exists() and any(name.endswith(".tmp") for name in os.listdir(output))

    result, new_node = lose_the_node_mid_way(ray_cluster, "tfdag_score_kill", score, scoring)
    assert result.num_rows == local.num_rows == 18000
    _same_predictions(_parts(str(output)), pd.read_parquet(tmp_path / "local.parquet"))
    assert sorted(os.listdir(output)) == sorted([*(f"part-{i:05d}.parquet" for i in range(6)), tables.PARTS_MARKER])
    assert any(name.startswith(new_node[:12]) for name in result.nodes), result.nodes


def test_scoring_on_ray_reads_and_writes_s3(ray_cluster, species_model, s3, tmp_path):
    """Input and output on moto's S3 (the nodes have its endpoint and credentials): the parts are uploaded whole, the
    marker last, and read back as the local engine's output."""
    source = write_csvs(tmp_path / "src", files=2, rows=300)
    for path in sorted(glob.glob(source)):
        s3.fs.put_file(path, f"{BUCKET}/rows/{os.path.basename(path)}")
    local = predict(PredictConfig(model=species_model, input=source, output=str(tmp_path / "local.parquet"),
                                  keep=("n",)))
    output = f"s3://{BUCKET}/scored/today.parquet"
    result = predict(PredictConfig(model=species_model, input=f"s3://{BUCKET}/rows/*.csv", output=output,
                                   keep=("n",), engine=DataEngine.RAY,
                                   ray=RayScoring(address=ray_cluster.address, node_ip_address=RAY_IP)))
    assert result.num_rows == local.num_rows == 600
    names = sorted(os.path.basename(p) for p in s3.fs.ls(f"{BUCKET}/scored/today.parquet"))
    assert names == sorted(["part-00000.parquet", "part-00001.parquet", tables.PARTS_MARKER]), names
    parts = pd.concat([pd.read_parquet(s3.fs.open(f"{BUCKET}/scored/today.parquet/part-{i:05d}.parquet", "rb"))
                       for i in range(2)], ignore_index=True)
    _same_predictions(parts, pd.read_parquet(tmp_path / "local.parquet"))
    assert tables.read_metadata(output)["rows"] == 600


def test_the_batch_predict_flow_scores_on_ray_through_its_parameter(ray_cluster, species_model, prefect_api, tmp_path):
    """The `batch-predict` flow (here in this process, on the session's Prefect server) with `engine: ray` in its
    PredictConfig parameter: the same parts and marker, and the flow run's artifact names the engine."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.batch_predict import batch_predict

    source = write_csvs(tmp_path / "src", files=2, rows=200)
    output = tmp_path / "scored.parquet"
    state = batch_predict(PredictConfig(model=species_model, input=source, output=str(output), keep=("n",),
                                        engine=DataEngine.RAY,
                                        ray=RayScoring(address=ray_cluster.address, node_ip_address=RAY_IP)),
                          return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert (result.engine, result.num_rows) == ("ray", 400) and sum(result.nodes.values()) == 2
    assert tables.read_metadata(str(output))["parts"] == [{"path": f"part-{i:05d}.parquet", "rows": 200}
                                                           for i in range(2)]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["batch-predict"])))
    (artifact,) = [a for a in artifacts if a.flow_run_id == state.state_details.flow_run_id]
    assert "**engine:** ray, parts per node:" in artifact.data and "400 rows" in artifact.data
