"""Tests for pipeline_lib.testing.export_faults: a fault added to the model check's hooks for one block."""

from __future__ import annotations

import pytest

from pipeline_lib.serving import validation
from pipeline_lib.serving.tfdag_scoring import SERVING_JSON
from pipeline_lib.testing.export_faults import ExportFaultError, breaking_exports


def test_the_fault_breaks_each_checked_export_within_the_block_only(tmp_path):
    (tmp_path / SERVING_JSON).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / SERVING_JSON).write_text("{}")
    with breaking_exports("drop_serving_json"):
        (fn,) = validation.before_check_fns
        fn(str(tmp_path))
    assert not (tmp_path / SERVING_JSON).exists() and validation.before_check_fns == []
    with pytest.raises(ExportFaultError, match=r"export fault 'melt' is none of \['corrupt_variables'"), \
            breaking_exports("melt"):
        pass
    assert validation.before_check_fns == []
