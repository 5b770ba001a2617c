"""Tests for pipeline_lib.checkpoints.layout: checkpoint names and the step a file belongs to."""

from __future__ import annotations

import os

from pipeline_lib.checkpoints import layout


def test_names_of_a_step():
    assert layout.prefix_for("/run/checkpoints", 300) == os.path.join("/run/checkpoints", "ckpt-300")
    assert layout.manifest_name(300) == "ckpt-300.manifest.json"
    assert layout.manifest_path("/run/ckpt-300") == "/run/ckpt-300.manifest.json"


def test_steps_are_read_back_only_from_checkpoint_names():
    assert layout.step_of_prefix("ckpt-300") == 300
    assert layout.step_of_prefix("ckpt-300.index") is None
    assert layout.step_of_manifest("ckpt-7.manifest.json") == 7
    assert layout.step_of_manifest("ckpt-7.index") is None
    assert [layout.step_of_file(n) for n in ("ckpt-7.index", "ckpt-7.data-00000-of-00001",
                                             "ckpt-7.manifest.json", "checkpoint", "ckpt-x.index")] == [7, 7, 7, None, None]
