"""Tests for pipeline_lib.testing.preflight_override: a test's fake skew applied to this task's fingerprint."""

from __future__ import annotations

import pytest

from pipeline_lib.cluster.fingerprint import OVERRIDE_ENV, collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.core.secrets import MASK


def test_collect_fingerprint_applies_the_override_and_still_masks_secrets():
    environ = {"TF_API_TOKEN": "hunter2", "XLA_FLAGS": "--xla_x", OVERRIDE_ENV: '{"numpy": "1.0", "data_hash": "z"}'}
    fingerprint = collect_fingerprint(ClusterInfo(), "c", "d", environ=environ)
    assert fingerprint.env == {"TF_API_TOKEN": MASK, "XLA_FLAGS": "--xla_x"}
    assert "hunter2" not in fingerprint.model_dump_json()
    assert fingerprint.versions["numpy"] == "1.0" and fingerprint.data_hash == "z"
    assert fingerprint.overrides == ("data_hash", "numpy")
    with pytest.raises(PreflightError, match=r"TFDAG_PREFLIGHT_OVERRIDE sets unknown fingerprint field\(s\) "
                                             r"\['tensorfow'\]"):
        collect_fingerprint(ClusterInfo(), "c", "d", environ={OVERRIDE_ENV: '{"tensorfow": "1"}'})
    with pytest.raises(PreflightError, match=r"is not valid JSON"):
        collect_fingerprint(ClusterInfo(), "c", "d", environ={OVERRIDE_ENV: "tensorflow=1"})


def test_an_override_for_another_task_is_ignored():
    environ = {OVERRIDE_ENV: '{"task": "worker 1", "tensorflow": "2.13.1"}'}
    fingerprint = collect_fingerprint(ClusterInfo(), "c", "d", environ=environ)
    assert fingerprint.overrides == () and fingerprint.versions["tensorflow"] != "2.13.1"
    skewed = collect_fingerprint(ClusterInfo(task_index=1, cluster={"worker": ("h:1", "h:2")}), "c", "d",
                                 environ=environ)
    assert skewed.versions["tensorflow"] == "2.13.1" and skewed.overrides == ("tensorflow",)
