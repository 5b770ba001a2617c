"""Tests for pipeline_lib.testing.preflight_override: a test's fake skew applied to this task's fingerprint."""

from __future__ import annotations

import importlib.metadata

import pytest

from pipeline_lib.cluster.fingerprint import collect_fingerprint
from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.cluster.preflight import run_preflight
from pipeline_lib.cluster.preflight_report import PreflightError
from pipeline_lib.core.secrets import MASK
from pipeline_lib.testing.preflight_override import (
    OVERRIDE_ENV,
    apply_override,
    fingerprint_fn_from_env,
)
from tests.pipeline_lib.cluster.preflight_support import (
    fake_peer,
    listen_on,
    two_workers,
)


def test_the_override_replaces_fields_and_secrets_stay_masked():
    environ = {"TF_API_TOKEN": "hunter2", "XLA_FLAGS": "--xla_x", OVERRIDE_ENV: '{"numpy": "1.0", "data_hash": "z"}'}
    fingerprint = apply_override(collect_fingerprint(ClusterInfo(), "c", "d", environ=environ), environ)
    assert fingerprint.env == {"TF_API_TOKEN": MASK, "XLA_FLAGS": "--xla_x"}
    assert "hunter2" not in fingerprint.model_dump_json()
    assert fingerprint.versions["numpy"] == "1.0" and fingerprint.data_hash == "z"
    found = collect_fingerprint(ClusterInfo(), "c", "d", environ={})
    with pytest.raises(PreflightError, match=r"TFDAG_PREFLIGHT_OVERRIDE sets unknown fingerprint field\(s\) "
                                             r"\['tensorfow'\]"):
        apply_override(found, {OVERRIDE_ENV: '{"tensorfow": "1"}'})
    with pytest.raises(PreflightError, match=r"is not valid JSON"):
        apply_override(found, {OVERRIDE_ENV: "tensorflow=1"})


def test_an_override_for_another_task_is_ignored():
    environ = {OVERRIDE_ENV: '{"task": "worker 1", "tensorflow": "2.13.1"}'}
    found = collect_fingerprint(ClusterInfo(), "c", "d", environ={})
    assert apply_override(found, environ) == found
    worker_1 = ClusterInfo(task_index=1, cluster={"worker": ("h:1", "h:2")})
    skewed = apply_override(collect_fingerprint(worker_1, "c", "d", environ={}), environ)
    assert skewed.versions["tensorflow"] == "2.13.1"


def test_the_preflight_applies_the_override_through_its_fingerprint_fn(tmp_path):
    assert fingerprint_fn_from_env({}) is None
    fingerprint_fn = fingerprint_fn_from_env({OVERRIDE_ENV: '{"numpy": "1.0"}'})
    (fingerprint,) = run_preflight(str(tmp_path / "alone"), ClusterInfo(), "c", "d", timeout_s=30,
                                   fingerprint_fn=fingerprint_fn).fingerprints
    assert fingerprint.versions["numpy"] == "1.0"
    # Beside a peer as found, the faked node is what a real skew is: a mismatch that names the field.
    me, peer = two_workers()
    fake_peer(str(tmp_path / "pair"), peer)
    with listen_on(peer), pytest.raises(PreflightError) as error:
        run_preflight(str(tmp_path / "pair"), me, "c", "d", timeout_s=10, fingerprint_fn=fingerprint_fn)
    assert "the 2 tasks of this cluster do not match" in str(error.value)
    numpy_row = next(line for line in str(error.value).splitlines() if line.strip().startswith("numpy"))
    assert numpy_row.split()[:3] == ["numpy", "1.0", importlib.metadata.version("numpy")]
    assert "install the same numpy version on every node" in str(error.value)
    (plain,) = run_preflight(str(tmp_path / "again"), ClusterInfo(), "c", "d", timeout_s=30).fingerprints
    assert plain.versions["numpy"] != "1.0"
