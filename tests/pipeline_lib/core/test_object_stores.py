"""What differs between the object stores: URI forms, version markers, the failure descriptions (pure functions)."""

from __future__ import annotations

import pytest

from pipeline_lib.core import object_stores, storage

CONNECTION = ("DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
              "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;")


@pytest.mark.parametrize(("uri", "name"), [
    ("s3://b/x", "S3"), ("gs://b/x", "Google Cloud Storage"), ("gcs://b/x", "Google Cloud Storage"),
    ("az://c/x", "Azure Blob Storage"), ("abfs://c/x", "Azure Blob Storage"),
    ("wasbs://c@acct.blob.core.windows.net/x", "Azure Blob Storage"),
])
def test_each_uri_maps_to_its_store(uri, name):
    assert storage.object_store(uri).name == name


@pytest.mark.parametrize("uri", ["/tmp/x", "file:///tmp/x", "memory://x"])
def test_local_and_memory_uris_are_on_no_object_store(uri):
    assert storage.object_store(uri) is None


def test_az_artifact_locations_are_given_to_mlflow_in_its_wasbs_form(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", CONNECTION)
    assert storage.mlflow_artifact_uri("az://tfdag/mlflow") == \
        "wasbs://tfdag@devstoreaccount1.blob.core.windows.net/mlflow"
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "prodacct")
    assert storage.mlflow_artifact_uri("az://tfdag") == "wasbs://tfdag@prodacct.blob.core.windows.net/"
    for other in ("s3://b/mlflow", "gs://b/mlflow", "wasbs://c@a.blob.core.windows.net/m", "/tmp/mlruns"):
        assert storage.mlflow_artifact_uri(other) == other


def test_an_az_artifact_location_without_an_account_is_named(monkeypatch):
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(storage.StorageAccessError, match=r"tracking.artifact_location \('az://tfdag/mlflow'\).*"
                                                         r"AZURE_STORAGE_CONNECTION_STRING"):
        storage.mlflow_artifact_uri("az://tfdag/mlflow")


def test_mlflows_wasbs_form_opens_as_az(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    assert object_stores.fsspec_form("wasbs://tfdag@acct.blob.core.windows.net/mlflow/1", {}) == \
        ("az://tfdag/mlflow/1", {"account_name": "acct"})
    # A connection string (options or environment) names the account and the endpoint itself.
    assert object_stores.fsspec_form("wasbs://tfdag@acct.blob.core.windows.net/m", {"connection_string": "x"}) == \
        ("az://tfdag/m", {"connection_string": "x"})
    assert object_stores.fsspec_form("gs://b/x", {"token": "anon"}) == ("gs://b/x", {"token": "anon"})


@pytest.mark.parametrize(("info", "marker"), [
    ({"ETag": '"s3"', "LastModified": "t"}, '"s3"'),
    ({"etag": "gcs-md5", "generation": "17", "mtime": "t"}, "gcs-md5"),
    ({"generation": "17", "mtime": "t"}, "17"),
    ({"etag": '"0x1D"', "last_modified": "t"}, '"0x1D"'),
    ({"mtime": 1.5}, "1.5"),
    ({"size": 3}, None),
])
def test_the_version_marker_prefers_the_stores_own_field(info, marker):
    assert storage.version_marker(info) == marker


@pytest.mark.parametrize(("uri", "error", "expected"), [
    ("az://c/x", RuntimeError("Server failed to authenticate the request. ErrorCode:AuthenticationFailed"),
     "refused the credentials"),
    ("gs://b/x", KeyError("refresh_token"), "refused the credentials"),
    ("gs://b/x", RuntimeError("401 Unauthorized: Invalid Credentials"), "refused the credentials"),
    ("az://c/x", RuntimeError("Cannot connect to host 127.0.0.1:44013"), "cannot be reached"),
    ("s3://b/x", RuntimeError("An error occurred (InvalidAccessKeyId)"), "refused the credentials"),
    ("az://c/x", RuntimeError("ErrorCode:ContainerNotFound"), "the container 'c' of output_root"),
    ("gs://b/x", RuntimeError("404: The specified bucket does not exist."), "the bucket 'b' of output_root"),
    ("gs://b/x", ConnectionRefusedError("Connect call failed"), "cannot be reached"),
])
def test_each_stores_failures_are_described_with_the_uri(uri, error, expected):
    message = object_stores.describe_failure(error, "output_root", uri, "storage_options")
    assert expected in message and f"output_root ({uri!r})" in message
    if "credentials" in expected:
        assert storage.object_store(uri).credentials in message
