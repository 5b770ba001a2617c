"""Test-only: break an exported SavedModel just before the model check, driven by `TFDAG_EXPORT_FAULT`.

- `corrupt_variables`: the SavedModel's variables data is cut to half its size (storage that lost part of the
  export after it was written); `tf.saved_model.load` fails.
- `drop_serving_json`: `assets.extra/tfdag_serving.json` is removed (an export copied without its extras).

`serving.validation.validate_model` imports this module only when the variable is set, and breaks its own copy of
the export (the export directory itself when it is local). Never set TFDAG_EXPORT_FAULT outside tests.
"""

from __future__ import annotations

import glob
import logging
import os

from pipeline_lib.core.errors import UserError
from pipeline_lib.serving.tfdag_scoring import SERVING_JSON

logger = logging.getLogger(__name__)

FAULTS = ("corrupt_variables", "drop_serving_json")


class ExportFaultError(UserError, ValueError):
    """TFDAG_EXPORT_FAULT names no known fault."""


def break_export(saved_model_dir: str, fault: str) -> None:
    """Apply `fault` (one of FAULTS) to the local SavedModel at `saved_model_dir`.

    Raises:
        ExportFaultError: an unknown fault name.
    """
    fault = fault.strip()
    if fault == "corrupt_variables":
        for path in glob.glob(os.path.join(saved_model_dir, "variables", "variables.data-*")):
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
    elif fault == "drop_serving_json":
        os.remove(os.path.join(saved_model_dir, SERVING_JSON))
    else:
        raise ExportFaultError(f"TFDAG_EXPORT_FAULT ({fault!r}) is none of {list(FAULTS)}; unset it outside tests")
    logger.warning("TFDAG_EXPORT_FAULT %s broke the export at %s", fault, saved_model_dir)
