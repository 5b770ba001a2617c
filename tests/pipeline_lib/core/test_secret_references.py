"""`${SCHEME:NAME}` references to a store's secrets (core.secrets' resolver registry): resolved where storage is
opened, kept as written in every dump, handed to a worker process as a `TFDAG_SECRET_*` variable; and which keys of
a config hold a literal secret (PipelineConfig.literal_secrets, is_inline)."""

from __future__ import annotations

import pytest

from pipeline_lib.config import parse_config
from pipeline_lib.config.pipeline import is_inline
from pipeline_lib.core import secrets, storage
from pipeline_lib.core.secrets import MASK, SecretEnv, mask_secrets

STORE = {"aws-key": "s3cr3t-from-the-store", "tricky": "value-with-${HOME}-inside"}


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
    """A registry with one in-memory store under the scheme `test-store`; the names it was asked for."""
    monkeypatch.setattr(secrets, "_RESOLVERS", {})
    monkeypatch.setattr(secrets, "_RESOLVED", {})
    asked: list[str] = []

    def resolve(name: str) -> str:
        asked.append(name)
        if name not in STORE:
            raise LookupError(f"the test store has no secret {name!r}")
        return STORE[name]

    secrets.register_resolver("test-store", resolve)
    return asked


def test_expand_env_resolves_store_and_env_references_in_one_pass(lookups, monkeypatch):
    monkeypatch.setenv("TFDAG_TEST_USER", "alice")
    options = {"secret": "${test-store:aws-key}", "client_kwargs": {"token": "${TFDAG_TEST_USER}:${test-store:tricky}"}}
    assert storage.expand_env(options) == {
        "secret": "s3cr3t-from-the-store",
        # the store's value is not read again as a reference
        "client_kwargs": {"token": "alice:value-with-${HOME}-inside"}}
    storage.expand_env(options)
    assert lookups == ["aws-key", "tricky"]  # each fetched once per process
    assert options["secret"] == "${test-store:aws-key}"


def test_an_unknown_name_or_scheme_names_the_option_the_reference_and_the_fix(lookups):
    with pytest.raises(storage.StorageAccessError, match=r"^storage_options.secret refers to "
                                                         r"\$\{test-store:missing\}: the test store has no secret"):
        storage.expand_env({"secret": "${test-store:missing}"})
    with pytest.raises(storage.StorageAccessError, match=r"storage_options.key refers to \$\{vault:x\}, and no "
                                                         r"resolver for 'vault' is registered .*registered: test-store"):
        storage.expand_env({"key": "${vault:x}"})
    with pytest.raises(ValueError, match="lowercase"):
        secrets.register_resolver("Vault", str)


def test_a_store_reference_is_kept_in_dumps_and_resolved_into_the_environment_of_a_process(lookups):
    options = {"key": "AKIA", "secret": "${test-store:aws-key}"}
    assert mask_secrets(options) == {"key": MASK, "secret": "${test-store:aws-key}"}
    assert secrets.mask_url_passwords("http://me:${test-store:aws-key}@host") == "http://me:${test-store:aws-key}@host"
    assert lookups == []  # masking resolves nothing

    env = SecretEnv()
    written = mask_secrets(options, env)
    assert written["secret"].startswith("${TFDAG_SECRET_") and env.env[written["secret"][2:-1]] == STORE["aws-key"]

    kept = SecretEnv(resolve_stores=False)
    assert mask_secrets(options, kept)["secret"] == "${test-store:aws-key}"
    assert list(kept.env.values()) == ["AKIA"]


def test_a_config_with_a_store_reference_writes_it_as_written_and_a_worker_spec_holds_no_value(lookups):
    config = parse_config({"data": {"source": "s3://b/raw.csv", "label": "y",
                                    "storage_options": {"secret": "${test-store:aws-key}"}},
                           "output_root": "s3://b/out", "storage_options": {"secret": "${test-store:aws-key}"},
                           "tracking": {"mlflow_uri": "http://me:${test-store:aws-key}@host:5000"}})
    assert "${test-store:aws-key}" in config.masked_yaml() and STORE["aws-key"] not in config.masked_yaml()
    assert config.literal_secrets() == []
    assert lookups == []
    values, env = config.for_process()
    assert STORE["aws-key"] not in str(values) and list(env.values()) == [STORE["aws-key"]]
    assert values["storage_options"]["secret"] == values["data"]["storage_options"]["secret"]
    assert values["tracking"]["mlflow_uri"].startswith("http://me:${TFDAG_SECRET_")


def test_literal_secrets_names_the_key_path_of_each_literal_credential():
    config = parse_config({"data": {"source": "s3://b/raw.csv", "label": "y",
                                    "storage_options": {"client_kwargs": {"aws_session_token": "tok"}}},
                           "output_root": "s3://b/out", "storage_options": {"key": "${AWS_KEY}", "secret": "s3cr3t",
                                                                            "anon": False},
                           "tracking": {"mlflow_uri": "http://me:pw@host:5000"}})
    assert sorted(config.literal_secrets()) == ["data.storage_options.client_kwargs.aws_session_token",
                                                "storage_options.secret", "tracking.mlflow_uri"]


def test_is_inline_tells_content_from_a_path_or_a_config(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("data: {source: x, label: y}\n")
    assert is_inline("data:\n  source: x\n") and is_inline("{data: {source: x, label: y}}") and is_inline({})
    assert not is_inline(str(path)) and not is_inline(parse_config({"data": {"source": "x", "label": "y"}}))


def test_a_store_reference_under_any_name_reaches_a_process_as_a_variable(lookups):
    env = SecretEnv()
    written = mask_secrets({"client_kwargs": {"endpoint_url": "${test-store:aws-key}", "region_name": "${REGION}"}},
                           env)
    assert written["client_kwargs"]["region_name"] == "${REGION}"
    assert env.env[written["client_kwargs"]["endpoint_url"][2:-1]] == STORE["aws-key"]
