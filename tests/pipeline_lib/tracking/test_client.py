"""The MLflow client helpers: the sqlite directory, the scoped process-wide URIs, tags without credentials."""

from __future__ import annotations

import os

import mlflow

from pipeline_lib.tracking import client


def test_create_client_makes_the_sqlite_directory(tmp_path):
    uri = f"sqlite:///{tmp_path}/nested/store/mlflow.db"
    created = client.create_client(uri)
    assert os.path.isdir(tmp_path / "nested" / "store")
    assert created.tracking_uri == uri


def test_global_tracking_uri_is_scoped_to_the_call(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with client.global_tracking_uri(uri):
        assert mlflow.get_tracking_uri() == uri
        assert os.environ.get("MLFLOW_TRACKING_URI") == uri
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert mlflow.get_tracking_uri() != uri


def test_clean_tags_drops_credential_names_and_truncates():
    cleaned = client.clean_tags({"aws_secret_access_key": "x", "api_token": "y", "run": 7,
                                 "long": "a" * (client.MAX_TAG_VALUE + 10)})
    assert cleaned == {"run": "7", "long": "a" * client.MAX_TAG_VALUE}
    assert client.clean_tags(None) == {}
