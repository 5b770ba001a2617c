"""Tests for pipeline_lib.cluster.probe: the environment variables a report shows, secrets masked."""

from __future__ import annotations

from pipeline_lib.cluster.probe import relevant_env
from pipeline_lib.core.secrets import MASK


def test_relevant_env_picks_tf_and_xla_variables_and_masks_secrets():
    picked = relevant_env({"TF_API_TOKEN": "tok", "XLA_FLAGS": "--xla_dump_to=/tmp", "HOME": "/root",
                           "TF_CONFIG": "{}"})
    assert picked == {"TF_API_TOKEN": MASK, "TF_CONFIG": "{}", "XLA_FLAGS": "--xla_dump_to=/tmp"}
