"""Test support: fault injection, example-id records, a faked node loss or skew, stage stops and in-memory doubles.

Production code never imports this package, with one exception: the worker entry
(`pipeline_lib.launch.worker.worker_main`) imports `worker_support` when a test set one of its variables
(TFDAG_FAULT, TFDAG_TEST_EXAMPLE_IDS, TFDAG_PREFLIGHT_OVERRIDE). Everything here acts through public hooks:

- in a worker process (`worker_support`): `WorkerAdditions`, i.e. more `TrainHooks` (`faults.FaultHooks`,
  `example_ids.ExampleIdRecorder`), a before-result callback (the `result` fault point) and `run_preflight`'s
  `fingerprint_fn` (`preflight_override`). A worker is a process a test does not run itself, so the variables are
  how a test reaches it; the entry reads nothing else of them.
- in the test's own process, where the launcher and a flow run: `local_nodes.local_nodes(path)` replaces the local
  group's `capacity`, `export_faults.breaking_exports(fault)` adds to `serving.validation.before_check_fns`,
  `stage_stop.stop_at_stage(stage)` listens to the flow's stage events (`core.events`). No variable is read there.
"""
