"""Shared fixtures of the checkpoint tests: a fresh remote run directory on fsspec's memory filesystem."""

from __future__ import annotations

import uuid

import fsspec
import pytest

MEMORY = fsspec.filesystem("memory")


@pytest.fixture
def remote_dir():
    bucket = f"tfdag-pub-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}/runs/r1/checkpoints"
    if MEMORY.exists(f"/{bucket}"):
        MEMORY.rm(f"/{bucket}", recursive=True)
