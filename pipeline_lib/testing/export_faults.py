"""Test-only: break an exported SavedModel just before the model check.

- `corrupt_variables`: the SavedModel's variables data is cut to half its size (storage that lost part of the
  export after it was written); `tf.saved_model.load` fails.
- `drop_serving_json`: `assets.extra/tfdag_serving.json` is removed (an export copied without its extras).

`breaking_exports(fault)` adds the fault to `serving.validation.before_check_fns` for the length of a block, so every
model check in this process (a flow run in the test's process included) breaks its copy of the export (the export
directory itself when it is local) before the fresh process loads it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
from collections.abc import Iterator

from pipeline_lib.core.errors import UserError
from pipeline_lib.serving import validation
from pipeline_lib.serving.tfdag_scoring import SERVING_JSON

logger = logging.getLogger(__name__)

FAULTS = ("corrupt_variables", "drop_serving_json")


class ExportFaultError(UserError, ValueError):
    """An export fault that is none of FAULTS."""


def _check(fault: str) -> str:
    fault = fault.strip()
    if fault not in FAULTS:
        raise ExportFaultError(f"export fault {fault!r} is none of {list(FAULTS)}")
    return fault


def break_export(saved_model_dir: str, fault: str) -> None:
    """Apply `fault` (one of FAULTS) to the local SavedModel at `saved_model_dir`.

    Raises:
        ExportFaultError: an unknown fault name.
    """
    fault = _check(fault)
    if fault == "corrupt_variables":
        for path in glob.glob(os.path.join(saved_model_dir, "variables", "variables.data-*")):
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
    else:
        os.remove(os.path.join(saved_model_dir, SERVING_JSON))
    logger.warning("test export fault %s broke the export at %s", fault, saved_model_dir)


@contextlib.contextmanager
def breaking_exports(fault: str) -> Iterator[None]:
    """Within the block, every model check in this process breaks its export with `fault` first.

    Raises:
        ExportFaultError: an unknown fault name (before the block runs).
    """
    fn = functools.partial(break_export, fault=_check(fault))
    validation.before_check_fns.append(fn)
    try:
        yield
    finally:
        validation.before_check_fns.remove(fn)
