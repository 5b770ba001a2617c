"""How checkpoints are named: `ckpt-<step>` prefixes, their manifests, and the step a file belongs to."""

from __future__ import annotations

import os
import re

PREFIX_NAME = "ckpt"
MANIFEST_SUFFIX = ".manifest.json"
_PREFIX_RE = re.compile(rf"^{PREFIX_NAME}-(\d+)$")
_MANIFEST_RE = re.compile(rf"^{PREFIX_NAME}-(\d+){re.escape(MANIFEST_SUFFIX)}$")
_FILE_RE = re.compile(rf"^{PREFIX_NAME}-(\d+)\.")


def prefix_name(step: int) -> str:
    """The checkpoint prefix's base name of a step: `ckpt-<step>`."""
    return f"{PREFIX_NAME}-{step}"


def prefix_for(checkpoint_dir: str, step: int) -> str:
    """The checkpoint prefix of a step: `<dir>/ckpt-<step>`."""
    return os.path.join(checkpoint_dir, prefix_name(step))


def manifest_name(step: int) -> str:
    """The file name of a step's manifest: `ckpt-<step>.manifest.json`."""
    return prefix_name(step) + MANIFEST_SUFFIX


def manifest_path(prefix: str) -> str:
    """The manifest of a checkpoint prefix."""
    return prefix + MANIFEST_SUFFIX


def step_of_prefix(name: str) -> int | None:
    """The step of a prefix base name (`ckpt-300` → 300); None for any other name."""
    match = _PREFIX_RE.match(name)
    return int(match.group(1)) if match else None


def step_of_manifest(name: str) -> int | None:
    """The step of a manifest file name (`ckpt-300.manifest.json` → 300); None for any other name."""
    match = _MANIFEST_RE.match(name)
    return int(match.group(1)) if match else None


def step_of_file(name: str) -> int | None:
    """The step of any file of a checkpoint (`ckpt-300.index`, its data files, its manifest); None otherwise."""
    match = _FILE_RE.match(name)
    return int(match.group(1)) if match else None
