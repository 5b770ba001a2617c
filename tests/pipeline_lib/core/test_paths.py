"""Tests for pipeline_lib.core.paths: the cache root."""

from __future__ import annotations

from pipeline_lib.core import paths


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "c"))
    assert paths.default_cache_dir() == str(tmp_path / "c")
