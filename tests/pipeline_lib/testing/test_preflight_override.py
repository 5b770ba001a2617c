"""Tests for pipeline_lib.testing.preflight_override: a test's fake skew applied to this task's fingerprint."""

from __future__ import annotations

import pytest

from pipeline_lib.cluster.fingerprint import OVERRIDE_ENV, collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.core.secrets import MASK
from pipeline_lib.testing.preflight_override import apply_override


def test_the_override_replaces_fields_and_secrets_stay_masked():
    environ = {"TF_API_TOKEN": "hunter2", "XLA_FLAGS": "--xla_x", OVERRIDE_ENV: '{"numpy": "1.0", "data_hash": "z"}'}
    fingerprint = apply_override(collect_fingerprint(ClusterInfo(), "c", "d", environ=environ), environ)
    assert fingerprint.env == {"TF_API_TOKEN": MASK, "XLA_FLAGS": "--xla_x"}
    assert "hunter2" not in fingerprint.model_dump_json()
    assert fingerprint.versions["numpy"] == "1.0" and fingerprint.data_hash == "z"
    assert fingerprint.overrides == ("data_hash", "numpy")
    found = collect_fingerprint(ClusterInfo(), "c", "d", environ={})
    with pytest.raises(PreflightError, match=r"TFDAG_PREFLIGHT_OVERRIDE sets unknown fingerprint field\(s\) "
                                             r"\['tensorfow'\]"):
        apply_override(found, {OVERRIDE_ENV: '{"tensorfow": "1"}'})
    with pytest.raises(PreflightError, match=r"is not valid JSON"):
        apply_override(found, {OVERRIDE_ENV: "tensorflow=1"})


def test_an_override_for_another_task_is_ignored():
    environ = {OVERRIDE_ENV: '{"task": "worker 1", "tensorflow": "2.13.1"}'}
    fingerprint = apply_override(collect_fingerprint(ClusterInfo(), "c", "d", environ={}), environ)
    assert fingerprint.overrides == () and fingerprint.versions["tensorflow"] != "2.13.1"
    worker_1 = ClusterInfo(task_index=1, cluster={"worker": ("h:1", "h:2")})
    skewed = apply_override(collect_fingerprint(worker_1, "c", "d", environ={}), environ)
    assert skewed.versions["tensorflow"] == "2.13.1" and skewed.overrides == ("tensorflow",)


def test_the_preflight_applies_the_override_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, '{"numpy": "1.0"}')
    report = run_preflight(str(tmp_path), ClusterInfo(), "c", "d", timeout_s=30)
    (fingerprint,) = report.fingerprints
    assert fingerprint.versions["numpy"] == "1.0" and fingerprint.overrides == ("numpy",)
    assert any("numpy" in warning for warning in report.warnings), report.warnings
    monkeypatch.delenv(OVERRIDE_ENV)
    (plain,) = run_preflight(str(tmp_path / "again"), ClusterInfo(), "c", "d", timeout_s=30).fingerprints
    assert plain.overrides == () and plain.versions["numpy"] != "1.0"
