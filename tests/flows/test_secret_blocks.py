"""A storage credential from a real Prefect Secret block (`${prefect-secret:NAME}`, saved on the session's Prefect
server) opens moto's S3 where the flow opens storage, reaches a worker process's environment only, and is recorded
nowhere in Prefect: the flow run's parameter holds the reference as written.

moto checks every request's signature against an IAM user here (the `s3` store's `wrong_credentials`), so the block's
value is what signs: a block holding a wrong secret is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from prefect import flow
from prefect.blocks.system import Secret

from pipeline_lib.config import parse_config
from pipeline_lib.core import storage
from pipeline_lib.core.storage import StorageAccessError
from pipeline_lib.data import demo as demo_data
from tests.canary import Canary, search_prefect
from tests.stores.conftest import BUCKET, s3, s3_server  # noqa: F401 - the S3 fixtures

KEY_ENV = "TFDAG_TEST_BLOCK_KEY_ID"
ROOT = Path(__file__).resolve().parents[2]


@flow(name="open-storage-with-a-secret-block")
def open_storage(config: str) -> int:
    """The training pipeline's own parameter handling and its first two tasks: the storage check and conversion."""
    from flows.flow_config import load_flow_config
    from tasks import stages

    loaded = load_flow_config(config)
    stages.check_storage(loaded)
    return stages.convert_to_tfrecords(loaded).num_records("train")


def _config_text(block: str, name: str) -> str:
    options = {"key": f"${{{KEY_ENV}}}", "secret": f"${{prefect-secret:{block}}}"}
    return yaml.safe_dump({
        "name": name,
        "data": {"source": f"s3://{BUCKET}/raw/digits.csv", "label": "target", "target_shard_mb": 0.1,
                 "storage_options": options},
        "output_root": f"s3://{BUCKET}/tfdag", "storage_options": options,
    })


def test_a_secret_block_reference_signs_s3_requests_and_is_recorded_as_written(s3, prefect_api, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    good, wrong, _ = s3.wrong_credentials(tmp_path, monkeypatch)  # from here on moto checks every signature
    demo_data.write_digits_csv(f"s3://{BUCKET}/raw/digits.csv", good)
    monkeypatch.setenv(KEY_ENV, good["key"])
    block = f"tfdag-test-{uuid.uuid4().hex[:12]}"
    Secret(value=good["secret"]).save(block, _sync=True)
    text = _config_text(block, f"block-{tmp_path.name}")

    state = open_storage(text, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert state.result() > 0
    fs, root = storage.get_fs(f"s3://{BUCKET}/tfdag", good)
    assert any("/train/part-" in path for path in fs.find(root))  # the shards, written with the block's credential

    canary = Canary(value=good["secret"])
    parameters = search_prefect(canary, str(state.state_details.flow_run_id))
    assert parameters["config"] == text  # inline YAML recorded as given: the reference, no value
    assert not canary.hits, canary.report()

    # The CLI's stage commands resolve the reference too (`tfdag convert` of the same config, as a file).
    path = tmp_path / "block.yaml"
    path.write_text(text)
    converted = subprocess.run([sys.executable, "-m", "flows.cli", "convert", str(path)], cwd=ROOT,
                               env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert good["secret"] not in converted.stdout + converted.stderr

    # A worker process gets the value in its environment only (the local and Ray launchers' for_process).
    values, env = parse_config(yaml.safe_load(text)).for_process()
    assert good["secret"] not in str(values) and good["secret"] in env.values()

    # The control: a block holding a wrong secret is refused by the store, naming the option.
    wrong_block = f"{block}-wrong"
    Secret(value=wrong["secret"]).save(wrong_block, _sync=True)
    refused = open_storage(_config_text(wrong_block, f"wrong-{tmp_path.name}"), return_state=True)
    assert refused.is_failed()
    with pytest.raises(StorageAccessError, match="output_root|data.source"):
        refused.result()


def test_a_reference_to_a_missing_block_names_the_option_and_how_to_create_it(prefect_api):
    name = f"tfdag-test-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StorageAccessError, match=rf"^storage_options.secret refers to \$\{{prefect-secret:{name}\}}: "
                                                 rf"Unable to find block document named {name}.*prefect block create "
                                                 "secret"):
        import flows.pipeline  # noqa: F401 - registers prefect-secret, as every flow process does
        storage.expand_env({"secret": f"${{prefect-secret:{name}}}"})


def test_prefect_deploy_templating_writes_a_block_template_s_value_but_leaves_the_reference(prefect_api):
    """What `prefect deploy` does to a deployment's config, parameters included (prefect.cli.deploy._core:
    resolve_block_document_references, resolve_variables, apply_values with the environment): Prefect's own
    `{{ prefect.blocks.secret.NAME }}` becomes the secret, to be stored with the deployment; our reference stays."""
    import asyncio
    import os

    from prefect.utilities.templating import (
        apply_values,
        resolve_block_document_references,
        resolve_variables,
    )

    block = f"tfdag-test-{uuid.uuid4().hex[:12]}"
    canary = Canary()
    Secret(value=canary.value).save(block, _sync=True)

    async def deploy_templating(config: dict) -> dict:
        config = await resolve_variables(await resolve_block_document_references(config))
        return apply_values(config, os.environ, remove_notset=False)

    ours = {"parameters": {"config": f"storage_options: {{secret: '${{prefect-secret:{block}}}'}}"}}
    theirs = {"parameters": {"config": f"storage_options: {{secret: '{{{{ prefect.blocks.secret.{block} }}}}'}}"}}
    assert asyncio.run(deploy_templating(ours)) == ours
    assert canary.value in str(asyncio.run(deploy_templating(theirs)))


def test_the_inline_example_in_prefect_yaml_names_its_secrets_and_holds_none():
    text = (Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml").read_text()
    lines = text.split("      # config: |\n", 1)[1].splitlines()
    example = "\n".join(line.removeprefix("      #   ") for line in lines[:4])
    config = parse_config(yaml.safe_load(example))
    assert config.literal_secrets() == []
    assert config.storage_options["secret"] == config.data.storage_options["secret"] == "${prefect-secret:aws-secret}"
