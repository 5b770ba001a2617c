"""Test-only: fake a skewed node in the cross-worker preflight through `TFDAG_PREFLIGHT_OVERRIDE`.

The variable holds a JSON object whose keys replace fields of this task's fingerprint before it is
written, e.g. `TFDAG_PREFLIGHT_OVERRIDE='{"tensorflow": "2.13.1"}'`; with `"task": "worker 1"` in the
object only that task applies it (how a whole local `tfdag run` fakes one skewed worker). Keys: the
version names (python, tensorflow, keras, protobuf, numpy, tfdag), `config_hash`, `data_hash`, the TF
build keys (`cuda_version`, `cudnn_version`, ...) and `gpus` (a list of {"device", "name", "memory_mb"}).
The worker entry (`worker_support`) passes `fingerprint_fn_from_env()` to `run_preflight` as its `fingerprint_fn`
when the variable is set; the task logs a warning naming the replaced fields. Never set it outside tests.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping

from pydantic import ValidationError

from pipeline_lib.cluster.fingerprint import Fingerprint
from pipeline_lib.cluster.preflight_report import PreflightError

logger = logging.getLogger(__name__)

OVERRIDE_ENV = "TFDAG_PREFLIGHT_OVERRIDE"


def apply_override(fingerprint: Fingerprint, environ: Mapping[str, str]) -> Fingerprint:
    """`fingerprint` with the fields `TFDAG_PREFLIGHT_OVERRIDE` names replaced (unchanged when it targets another task).

    Raises:
        PreflightError: the variable is not a JSON object, names an unknown field or gives one a value
            of the wrong type.
    """
    text = environ.get(OVERRIDE_ENV, "").strip()
    if not text:
        return fingerprint
    try:
        override = json.loads(text)
    except json.JSONDecodeError as error:
        raise PreflightError(f"{OVERRIDE_ENV} ({text!r}) is not valid JSON ({error}); write an object such as "
                             '\'{"tensorflow": "2.13.1"}\' or unset it') from None
    if not isinstance(override, dict):
        raise PreflightError(f"{OVERRIDE_ENV} ({text!r}) must be a JSON object of fingerprint fields")
    override = dict(override)
    target = override.pop("task", None)
    if target is not None and str(target) != fingerprint.task:
        return fingerprint
    values = fingerprint.model_dump()
    allowed = {*values["versions"], *values["tf_build"], "config_hash", "data_hash", "gpus"}
    unknown = sorted(set(override) - allowed)
    if unknown:
        raise PreflightError(f"{OVERRIDE_ENV} sets unknown fingerprint field(s) {unknown}; allowed: "
                             f"{sorted(allowed)}")
    for key, value in override.items():
        if key in values["versions"]:
            values["versions"][key] = str(value)
        elif key in values["tf_build"]:
            values["tf_build"][key] = str(value)
        else:
            values[key] = value
    try:
        faked = Fingerprint(**values)
    except ValidationError as error:
        raise PreflightError(f"{OVERRIDE_ENV} gives a field a value of the wrong type: {error}") from None
    logger.warning("%s (test-only) replaced %s of %s's preflight fingerprint", OVERRIDE_ENV,
                   ", ".join(sorted(override)), fingerprint.task)
    return faked


def fingerprint_fn_from_env(environ: Mapping[str, str] | None = None
                            ) -> Callable[[Fingerprint], Fingerprint] | None:
    """`run_preflight`'s `fingerprint_fn` that applies `TFDAG_PREFLIGHT_OVERRIDE` (read now), or None when unset."""
    environ = dict(os.environ if environ is None else environ)
    if not environ.get(OVERRIDE_ENV, "").strip():
        return None
    return lambda fingerprint: apply_override(fingerprint, environ)
