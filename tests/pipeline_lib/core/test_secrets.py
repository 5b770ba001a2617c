"""Tests for pipeline_lib.core.secrets: which names are secret and the masking of flat and nested settings."""

from __future__ import annotations

import pytest

from pipeline_lib.core.secrets import MASK, is_secret_name, mask_secrets


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "TF_API_TOKEN", "DB_PASSWORD", "my_key", "secret",
                                  "aws_session_token"])
def test_names_with_a_marker_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS", "endpoint_url", "client_kwargs", ""])
def test_other_names_are_not_secret(name):
    assert not is_secret_name(name)


def test_mask_secrets_masks_secret_names_only():
    env = {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "TF_API_TOKEN": "tok", "DB_PASSWORD": "pw", "my_key": "k",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    masked = mask_secrets(env)
    assert masked == {"AWS_SECRET_ACCESS_KEY": MASK, "TF_API_TOKEN": MASK, "DB_PASSWORD": MASK, "my_key": MASK,
                      "TF_CPP_MIN_LOG_LEVEL": "2"}
    assert env["TF_API_TOKEN"] == "tok"  # a copy


def test_mask_secrets_masks_nested_storage_options():
    options = {"key": "AKIA", "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": "t"}}
    assert mask_secrets(options) == {"key": MASK, "secret": MASK,
                                     "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": MASK}}
    assert options["client_kwargs"]["aws_session_token"] == "t"  # a copy, nested values included


def test_a_secret_name_masks_its_whole_nested_value_and_none_is_empty():
    assert mask_secrets({"credentials_token": {"a": 1}}) == {"credentials_token": MASK}
    assert mask_secrets(None) == {}


def test_a_url_password_is_masked_and_a_reference_in_it_kept():
    from pipeline_lib.core.secrets import mask_url_passwords

    assert mask_url_passwords("at http://alice:pa55@host:5000/x") == f"at http://alice:{MASK}@host:5000/x"
    assert mask_url_passwords("http://alice:${PW}@host") == "http://alice:${PW}@host"
    assert mask_url_passwords("http://host:5000") == "http://host:5000"


def test_secret_env_turns_literals_into_references_and_keeps_references():
    from pipeline_lib.core.secrets import SecretEnv

    env = SecretEnv()
    options = {"key": "AKIA", "secret": "s3cr3t", "token": "${MY_TOKEN}", "anon": False,
               "client_kwargs": {"endpoint_url": "http://u:pw@h", "aws_session_token": "s3cr3t"}}
    written = mask_secrets(options, env)
    assert written["token"] == "${MY_TOKEN}" and written["anon"] is False
    assert written["secret"] == written["client_kwargs"]["aws_session_token"]  # one variable per value
    resolved = {f"${{{name}}}": value for name, value in env.env.items()}
    assert resolved[written["key"]] == "AKIA" and resolved[written["secret"]] == "s3cr3t"
    assert all(name.startswith("TFDAG_SECRET_") for name in env.env)
    assert "pw" not in str(written) and "pw" in env.env.values()
