"""Test-only: what the worker entry adds to a task when a test sets one of its variables.

`pipeline_lib.launch.worker.worker_main` (every worker process: `python -m pipeline_lib.launch.worker`, the fork
server's children, `tfdag worker`) imports this module only when one of `worker.TEST_SUPPORT_VARIABLES` is set, and
passes `additions_from_env` to `run_worker`. The variables reach the workers as any environment does: a test's
`env=` to a launcher, or its own environment, which the workers inherit.

- `TFDAG_FAULT` (`faults`): a training task fires its faults through `FaultHooks` and the result point.
- `TFDAG_TEST_EXAMPLE_IDS` (`example_ids`): a training task records the example ids it feeds.
- `TFDAG_PREFLIGHT_OVERRIDE` (`preflight_override`): every task fakes fields of its preflight fingerprint.

Training in the caller's own process (`train.isolation: none`) gets none of them: faults act on processes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pipeline_lib.cluster.info import ClusterInfo
from pipeline_lib.config import PipelineConfig
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.launch.additions import WorkerAdditions, is_server_task
from pipeline_lib.launch.spec import WorkerSpec
from pipeline_lib.testing import faults, preflight_override
from pipeline_lib.testing.example_ids import EXAMPLE_IDS_ENV, ExampleIdRecorder

VARIABLES = (faults.FAULT_ENV, EXAMPLE_IDS_ENV, preflight_override.OVERRIDE_ENV)


def additions_from_env(spec: WorkerSpec, config: PipelineConfig, cluster: ClusterInfo, manifest: Manifest,
                       environ: Mapping[str, str] | None = None) -> WorkerAdditions:
    """This task's test additions from `environ` (default os.environ): see the module docstring.

    Raises:
        FaultSpecError: TFDAG_FAULT is set but malformed.
    """
    environ = os.environ if environ is None else environ
    fingerprint_fn = preflight_override.fingerprint_fn_from_env(environ)
    if is_server_task(config, cluster):  # ps and worker tasks of parameter_server run no training loop
        return WorkerAdditions(fingerprint_fn=fingerprint_fn)
    hooks, before_result = [], []
    injector = faults.injector_from_env(cluster.worker_index, spec.run_dir, environ,
                                        storage_options=config.storage_options)
    if injector is not None:
        injector.install_save_hook()
        fault_hooks = faults.FaultHooks(injector)
        hooks.append(fault_hooks)
        before_result.append(fault_hooks.before_result)
    directory = environ.get(EXAMPLE_IDS_ENV)
    if directory:
        # Under parameter_server the training workers are the `worker` job (the chief coordinates).
        num_workers = len(cluster.cluster["worker"]) if cluster.has_ps else cluster.num_workers
        hooks.append(ExampleIdRecorder(directory, manifest.feature_schema, num_workers))
    return WorkerAdditions(hooks=tuple(hooks), before_result=tuple(before_result), fingerprint_fn=fingerprint_fn)
