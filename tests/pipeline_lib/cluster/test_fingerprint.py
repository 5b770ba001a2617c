"""Tests for pipeline_lib.cluster.fingerprint: what one task reports about itself, secrets masked."""

from __future__ import annotations

from pipeline_lib.cluster.fingerprint import collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.core.secrets import MASK


def test_fingerprint_masks_secrets():
    environ = {"TF_API_TOKEN": "hunter2", "XLA_FLAGS": "--xla_x"}
    fingerprint = collect_fingerprint(ClusterInfo(), "c", "d", environ=environ)
    assert fingerprint.env == {"TF_API_TOKEN": MASK, "XLA_FLAGS": "--xla_x"}
    assert "hunter2" not in fingerprint.model_dump_json()
    assert fingerprint.slot == "worker-0"
