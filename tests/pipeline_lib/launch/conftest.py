"""The launcher tests' shared data: a small dataset on disk that worker processes (or threads) can load."""

from __future__ import annotations

import pytest

from tests.pipeline_lib.launch_support import write_dataset_on_disk


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """512 train and 64 eval records with their manifest.json, written once per test module."""
    return write_dataset_on_disk(str(tmp_path_factory.mktemp("launch_data")), num_train=512, num_eval=64)
