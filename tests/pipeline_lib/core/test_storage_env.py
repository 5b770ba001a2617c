"""Storage options may reference environment variables, so configs (and Prefect parameters) hold no secret."""

import pytest

from pipeline_lib.core import storage


def test_env_references_expand_recursively(monkeypatch):
    monkeypatch.setenv("TFDAG_TEST_SECRET", "s3cr3t")
    options = {"secret": "${TFDAG_TEST_SECRET}", "client_kwargs": {"token": "x-${TFDAG_TEST_SECRET}"},
               "list": ["${TFDAG_TEST_SECRET}"], "anon": False}
    assert storage.expand_env(options) == {"secret": "s3cr3t", "client_kwargs": {"token": "x-s3cr3t"},
                                           "list": ["s3cr3t"], "anon": False}
    assert options["secret"] == "${TFDAG_TEST_SECRET}"  # the config's own value is untouched


def test_unset_reference_names_the_option_and_variable(monkeypatch):
    monkeypatch.delenv("TFDAG_TEST_UNSET", raising=False)
    with pytest.raises(storage.StorageError, match=r"storage_options.key refers to the environment variable "
                                                    r"TFDAG_TEST_UNSET, which is not set"):
        storage.expand_env({"key": "${TFDAG_TEST_UNSET}"})


def test_get_fs_uses_expanded_options(monkeypatch, tmp_path):
    monkeypatch.setenv("TFDAG_TEST_MODE", "True")
    fs, path = storage.get_fs(str(tmp_path), {"auto_mkdir": "${TFDAG_TEST_MODE}"})
    assert fs.auto_mkdir == "True" and path.endswith(tmp_path.name)
