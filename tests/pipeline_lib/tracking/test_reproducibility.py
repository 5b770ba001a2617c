"""Tests for tracking.reproducibility (what a run records) and reproduce.rerun's pure parts (weights, versions)."""

from __future__ import annotations

import math

import numpy as np
import yaml

from pipeline_lib.config import parse_config
from pipeline_lib.core.secrets import MASK, mask_secrets
from pipeline_lib.reproduce.rerun import _masked_keys, compare_weights
from pipeline_lib.tracking import reproducibility


def test_pip_freeze_lists_the_installed_tensorflow_and_parses_back():
    freeze = reproducibility.pip_freeze()
    versions = reproducibility.parse_pip_freeze(freeze + "-e git+https://x/y.git#egg=z\n# comment\n")
    import tensorflow as tf

    assert versions["tensorflow"] == tf.__version__
    assert versions == reproducibility.installed_distributions()


def test_version_differences_name_changed_added_and_removed_packages():
    recorded = {"numpy": "2.1.0", "keras": "3.10.0", "gone": "1.0"}
    installed = {"numpy": "2.1.0", "keras": "3.11.1", "new": "0.1"}
    assert reproducibility.version_differences(recorded, installed) == [
        "gone 1.0 → (not installed)", "keras 3.10.0 → 3.11.1", "new (not installed) → 0.1"]


def test_weights_survive_the_npz_round_trip_with_their_paths():
    weights = {"dense_0/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "logits/bias": np.ones(3, np.float32)}
    back = reproducibility.weights_from_npz(reproducibility.weights_to_npz(weights))
    assert sorted(back) == sorted(weights)
    assert all(np.array_equal(back[k], weights[k]) and back[k].dtype == weights[k].dtype for k in weights)


def test_compare_weights_reports_only_what_differs_by_its_largest_difference():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.zeros(2, np.float32), "only_a": np.zeros(1, np.float32)}
    b = {"w": np.array([1.0, 2.5], np.float32), "b": np.zeros(2, np.float32), "only_b": np.zeros(1, np.float32)}
    diff = compare_weights(a, b)
    assert set(diff) == {"w", "only_a", "only_b"} and diff["w"] == 0.5
    assert math.isnan(diff["only_a"]) and math.isnan(diff["only_b"])
    # One ulp is a difference: the comparison is bit for bit.
    c = {"w": np.nextafter(a["w"], np.float32(3.0))}
    assert compare_weights({"w": a["w"]}, c)["w"] > 0


def test_the_recorded_config_keeps_env_references_and_masks_secret_values():
    config = parse_config({"data": {"source": "s3://b/raw/*.csv", "label": "y", "split": {"key_columns": ["id"]},
                                    "storage_options": {"key": "${AWS_ACCESS_KEY_ID}", "secret": "hunter2"}}})
    text = config.masked_yaml()
    assert "${AWS_ACCESS_KEY_ID}" in text and "hunter2" not in text
    assert yaml.safe_load(text)["data"]["split"]["key_columns"] == ["id"]  # column names, not a secret
    assert mask_secrets({"token": "${A}${B}", "password": "x${A}"}) == {"token": "${A}${B}", "password": MASK}
    assert _masked_keys(yaml.safe_load(text)) == ["data.storage_options.secret"]


def test_a_record_says_why_a_run_is_not_reproducible():
    base = {"strategy": "default", "num_workers": 1, "num_replicas": 1, "per_replica_batch_size": 32,
            "global_batch_size": 32, "total_steps": 10, "seed": 1, "split_seed": 0, "deterministic": True,
            "shuffle": True, "jit_compile": False, "data_fingerprint": "f", "manifest_hash": "h", "dataset_uri": "/d",
            "export_step": 10, "export_selected_by": "latest", "tensorflow_version": "2.21.0", "keras_version": "3",
            "python_version": "3.11"}
    assert reproducibility.ReproductionRecord(**base).why_not_reproducible() is None
    assert "deterministic: false" in reproducibility.ReproductionRecord(
        **{**base, "deterministic": False}).why_not_reproducible()
    assert "asynchronously" in reproducibility.ReproductionRecord(
        **{**base, "strategy": "parameter_server"}).why_not_reproducible()
