"""Source listing: the files a URI or glob names, and the errors that name it."""

from __future__ import annotations

import pytest

from pipeline_lib.config import DataConfig
from pipeline_lib.core import storage
from pipeline_lib.core.errors import is_transient
from pipeline_lib.data.convert import convert
from pipeline_lib.data.errors import ConversionError
from pipeline_lib.data.sources import source_fingerprint


def test_source_matching_nothing_names_the_uri(tmp_path):
    uri = str(tmp_path / "raw" / "*.csv")
    with pytest.raises(ConversionError) as error:
        convert(DataConfig(source=uri, label="y"), str(tmp_path / "out"))
    assert uri in str(error.value) and "matches no files" in str(error.value)


class _UnreachableFs:
    """A filesystem whose every listing call fails the way a client fails while the endpoint is down."""

    protocol = "s3"

    def _down(self, *args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    glob = isdir = exists = find = info = _down


def test_an_outage_while_listing_is_storage_unavailable_not_a_conversion_error(monkeypatch):
    monkeypatch.setattr(storage, "get_fs", lambda uri, options=None: (_UnreachableFs(), "bucket/raw"))
    with pytest.raises(storage.StorageUnavailable) as caught:
        source_fingerprint(DataConfig(source="s3://bucket/raw", label="y"))
    assert "listing data.source 's3://bucket/raw'" in str(caught.value)
    assert is_transient(caught.value) and not isinstance(caught.value, ConversionError)


def test_refused_credentials_while_listing_stay_a_conversion_error(monkeypatch):
    class _Refusing(_UnreachableFs):
        def _down(self, *args, **kwargs):
            raise PermissionError("Access Denied")

        glob = isdir = exists = find = info = _down

    monkeypatch.setattr(storage, "get_fs", lambda uri, options=None: (_Refusing(), "bucket/raw"))
    with pytest.raises(ConversionError, match="cannot be listed .*PermissionError.*credentials"):
        source_fingerprint(DataConfig(source="s3://bucket/raw", label="y"))
