"""Training speed: tfdag's loop vs Keras `model.fit` with the same steps_per_execution, and 2-worker
MultiWorkerMirrored: tfdag's Keras 3 loop vs Keras 2 (`tf_keras`) `fit`, the only `fit` that runs there today.

What is timed, and why it is honest:

* Every rate is a **steady-state** rate: examples trained between the end of a warm-up step and the end of
  the last step, divided by the wall time between those two moments. Process start, the TensorFlow import,
  model building, `tf.function` tracing of the first execution and the final checkpoint/evaluation are all
  outside the window; epoch boundaries (a new input iterator, a refilled shuffle buffer) are inside it, for
  both sides alike. The custom loop is timed with `TrainHooks.on_step_end` (called after each execution),
  `model.fit` with a Keras callback's `on_train_batch_end`; neither hook does any work but read the clock.
  `TrainResult.examples_per_sec` is not used: its first interval includes the first trace.
* Both sides of a comparison use the same generated TFRecords, the same `create_model` MLP, the same batch,
  the same Adam optimizer and learning rate, and the same `create_dataset` input pipeline (shuffled, full
  batches). Cases alternate (A, B, A, B), at least 5 rounds, and the median and min-max are recorded, so a burst
  of load from other jobs on a shared machine penalises neither side systematically. CPU time per example (all threads of
  the measuring process) is printed as well: it does not depend on other jobs' load.
* The multi-worker case runs two real worker processes over 127.0.0.1 with a generated TF_CONFIG each (the
  same `training.train` entry a cluster runs), against two processes of `bench/keras2_worker.py` (Keras 2 `fit`
  under MultiWorkerMirroredStrategy, TF_USE_LEGACY_KERAS=1) with the same MLP, data and global batch; the
  chief's steady-state rate is the global rate (every step is an all-reduce, so the workers move in lock step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from bench import case, interleaved, not_run
from pipeline_lib.core.net import free_ports

# The loop executes this many steps per tf.function call in the main case; the sweep below shows why.
STEPS_PER_EXECUTION = 64
NUM_CLASSES = 10
# XLA on CPU is slower for this small MLP (bench/results.json has the ratio), from the per-step launch of the
# compiled cluster inside the loop's while loop. The target is a floor against regressions, not a goal: jit_compile
# is for accelerators and larger models.
JIT_TARGET = 0.15

WORKER_SOURCE = r'''
import json, os, sys, time
from pipeline_lib.training import loop as training
from pipeline_lib.training.hooks import TrainHooks
from pipeline_lib.config import parse_config
from pipeline_lib.data.manifest import Manifest
from pipeline_lib.planning.sharding import ShardPlan

args = json.loads(sys.argv[1])


class Clock(TrainHooks):
    def __init__(self):
        self.times = {}

    def on_step_end(self, step, examples, loss):
        self.times[step] = (time.perf_counter(), time.process_time())


clock = Clock()
result = training.train(parse_config(args["config"]), Manifest.model_validate_json(args["manifest"]),
                        ShardPlan.model_validate_json(args["plan"]), args["run_dir"], hooks=clock)
print("RESULT", json.dumps({"times": clock.times, "global_batch": result.global_batch_size,
                            "is_chief": result.is_chief, "num_workers": result.num_workers}), flush=True)
'''


def _config(batch: int, hidden: list[int], steps: int, spe: int, strategy: str = "default",
            jit_compile: bool = False):
    from pipeline_lib.config import parse_config

    return parse_config({
        "data": {"source": "generated.csv", "label": "label"},
        "model": {"params": {"hidden_units": hidden}},
        "train": {"strategy": strategy, "per_replica_batch_size": batch, "steps": steps,
                  "steps_per_execution": spe, "lr_scaling": "none", "base_learning_rate": 1e-3,
                  "jit_compile": jit_compile,
                  # No log line or checkpoint inside the timed window: both would cut executions short.
                  "log_every_steps": 10**9, "checkpoint_every_steps": 10**9},
    })


def execution_ends(total_steps: int, steps_per_epoch: int, steps_per_execution: int) -> set[int]:
    """The steps at which the loop's executions end (no log or checkpoint inside the run cuts them shorter)."""
    return {s for s in range(1, total_steps + 1)
            if (s % steps_per_epoch) % steps_per_execution == 0 or s == total_steps}


def steady_rate(times: dict[int, tuple[float, float]], warmup_steps: int, examples_per_step: int) -> tuple[float, float]:
    """(examples/s, CPU µs/example) between the first recorded step ≥ warmup_steps and the last step.

    Args:
        times: step → (perf_counter, process_time) when the execution that ended with that step returned;
            only execution ends, so that no step is counted that ran before the window opened.
        warmup_steps: steps excluded from the window (tracing, pipeline fill).
        examples_per_step: the global batch.

    Raises:
        ValueError: when fewer than two recorded steps lie in the window.
    """
    steps = sorted(int(s) for s in times)
    start = min((s for s in steps if s >= warmup_steps), default=None)
    if start is None or start == steps[-1]:
        raise ValueError(f"recorded steps {steps[:3]}...{steps[-3:]} leave no window after warm-up step "
                         f"{warmup_steps}; run more steps")
    (wall0, cpu0), (wall1, cpu1) = times[start], times[steps[-1]]
    examples = (steps[-1] - start) * examples_per_step
    return examples / (wall1 - wall0), (cpu1 - cpu0) / examples * 1e6


def _custom_loop(manifest, batch: int, hidden: list[int], steps: int, spe: int, warmup: int,
                 jit_compile: bool = False) -> tuple[float, float]:
    from pipeline_lib.planning.sharding import plan_shards
    from pipeline_lib.training import loop as training
    from pipeline_lib.training.hooks import TrainHooks

    class Clock(TrainHooks):
        def __init__(self):
            self.times = {}

        def on_step_end(self, step, examples, loss):
            self.times[step] = (time.perf_counter(), time.process_time())

    clock = Clock()
    plan = plan_shards(manifest, num_workers=1, replicas_per_worker=1, per_replica_batch_size=batch, epochs=1,
                       steps=steps, policy="data")
    with tempfile.TemporaryDirectory() as run_dir:
        training.train(_config(batch, hidden, steps, spe, jit_compile=jit_compile), manifest, plan, run_dir,
                       hooks=clock)
    ends = execution_ends(plan.total_steps, plan.steps_per_epoch, spe)
    return steady_rate({s: t for s, t in clock.times.items() if s in ends}, warmup, batch)


def _keras_fit(manifest, batch: int, hidden: list[int], steps: int, warmup: int, spe: int = 1) -> tuple[float, float]:
    import keras

    from pipeline_lib.training import input_pipeline, models
    from pipeline_lib.training.epochs import epoch_seed

    config = _config(batch, hidden, steps, spe)

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.epoch = {}, 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch_index, logs=None):
            # Called once per execution, with the index in the epoch of its last step.
            step = self.epoch * steps_per_epoch + batch_index + 1
            self.times[step] = (time.perf_counter(), time.process_time())

    steps_per_epoch = manifest.num_records("train") // batch
    model = models.create_model(config.model, manifest.feature_schema)
    model.compile(optimizer=keras.optimizers.Adam(config.train.base_learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=spe)
    dataset = input_pipeline.create_dataset(manifest, "train", batch, shuffle=True, seed=epoch_seed(42, 0),
                                            shuffle_buffer=config.train.shuffle_buffer, drop_remainder=True)
    clock = Clock()
    model.fit(dataset, epochs=-(-steps // steps_per_epoch), steps_per_epoch=None, verbose=0, callbacks=[clock])
    return steady_rate({s: t for s, t in clock.times.items() if s <= steps}, warmup, batch)


def _run_processes(directory: str, args: dict, num_workers: int, timeout_s: float = 600, script: str | None = None,
                   extra_env: dict[str, str] | None = None) -> dict:
    """Run `num_workers` training processes (MWMS over loopback when > 1, else Default); the chief's RESULT.

    `script` defaults to the tfdag worker (WORKER_SOURCE); `extra_env` is added to each process's environment.
    """
    if script is None:
        script = os.path.join(directory, "bench_worker.py")
        with open(script, "w") as handle:
            handle.write(WORKER_SOURCE)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    procs = []
    try:
        for index in range(num_workers):
            env = dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL="2", **(extra_env or {}))
            env.pop("TF_CONFIG", None)
            if num_workers > 1:
                env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                               "task": {"type": "worker", "index": index}})
            procs.append(subprocess.Popen([sys.executable, script, json.dumps(args)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs):
        if proc.returncode != 0 or "RESULT " not in output:
            raise RuntimeError(f"bench training process exited {proc.returncode}:\n{output[-3000:]}")
    return json.loads(outputs[0].split("RESULT ", 1)[1].splitlines()[0])


def _multi_worker(directory: str, manifest, per_worker_batch: int, hidden: list[int], steps: int, warmup: int,
                  num_workers: int) -> tuple[float, float]:
    from pipeline_lib.planning.sharding import plan_shards

    strategy = "multi_worker_mirrored" if num_workers > 1 else "default"
    batch = per_worker_batch if num_workers > 1 else per_worker_batch * 2
    config = _config(batch, hidden, steps, 1, strategy)
    plan = plan_shards(manifest, num_workers=num_workers, replicas_per_worker=1, per_replica_batch_size=batch,
                       epochs=1, steps=steps, policy="data")
    args = {"config": config.model_dump(mode="json"), "manifest": manifest.to_json(),
            # A fresh run_dir each time: an old one holds a finished checkpoint, and the run would be a no-op.
            "plan": plan.model_dump_json(), "run_dir": tempfile.mkdtemp(prefix=f"run-{num_workers}w-", dir=directory)}
    result = _run_processes(directory, args, num_workers)
    assert result["is_chief"] and result["num_workers"] == num_workers
    times = {int(s): tuple(t) for s, t in result["times"].items()}
    return steady_rate(times, warmup, result["global_batch"])


def _keras2_multi_worker(directory: str, manifest, global_batch: int, hidden: list[int], steps: int,
                         warmup: int) -> tuple[float, float]:
    """Keras 2 `fit` on 2 MWMS workers over loopback (bench/keras2_worker.py): the chief's steady rate."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras2_worker.py")
    args = {"manifest": manifest.to_json(), "global_batch": global_batch, "hidden": hidden, "steps": steps,
            "num_classes": NUM_CLASSES, "learning_rate": 1e-3, "steps_per_execution": 1}
    result = _run_processes(directory, args, 2, script=script, extra_env={"TF_USE_LEGACY_KERAS": "1"})
    times = {int(s): tuple(t) for s, t in result["times"].items()}
    return steady_rate(times, warmup, result["global_batch"])


def _rates(measure, cpu: list[float]):
    """A step for `interleaved`: runs `measure` (→ (rate, CPU µs)), keeps the CPU figure, returns the rate."""
    def step() -> float:
        rate, cpu_us = measure()
        cpu.append(cpu_us)
        return rate
    return step


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def run(rows: int = 200_000, width: int = 32, quick: bool = False) -> list[dict]:
    from bench.bench_input import _manifest, _write_records

    rows = 8_192 if quick else 32_768
    repeats = 2 if quick else 5
    cases = []
    with tempfile.TemporaryDirectory() as directory:
        names = [f"part-{i:05d}.tfrecord" for i in range(4)]
        layout = _write_records([os.path.join(directory, n) for n in names], rows, width, NUM_CLASSES)
        manifest = _manifest(directory, names, width, rows, layout, NUM_CLASSES)
        # (a) the loop vs model.fit, both executing STEPS_PER_EXECUTION steps per call: the default MLP (128, 64),
        # two epochs, at two trainer batch sizes.
        hidden = [128, 64]
        for batch in (32, 256):
            steps = 2 * (rows // batch)
            warmup = max(steps // 10, min(2 * STEPS_PER_EXECUTION, steps // 4))
            spe = STEPS_PER_EXECUTION if (rows // batch) % STEPS_PER_EXECUTION == 0 else rows // batch
            cpu: dict[str, list[float]] = {"loop": [], "fit": []}
            samples = interleaved({
                "loop": _rates(lambda b=batch, s=steps, w=warmup, e=spe: _custom_loop(manifest, b, hidden, s, e, w),
                               cpu["loop"]),
                "fit": _rates(lambda b=batch, s=steps, w=warmup, e=spe: _keras_fit(manifest, b, hidden, s, w, spe=e),
                              cpu["fit"]),
            }, repeats)
            print(f"training batch {batch}, MLP {hidden}, {steps} steps, steps_per_execution {spe} on both sides: "
                  f"tfdag loop {_median(samples['loop']):,.0f} ex/s (min {min(samples['loop']):,.0f}, max "
                  f"{max(samples['loop']):,.0f}; {_median(cpu['loop']):.1f} CPU µs/ex) | model.fit "
                  f"{_median(samples['fit']):,.0f} ex/s (min {min(samples['fit']):,.0f}, max {max(samples['fit']):,.0f}; "
                  f"{_median(cpu['fit']):.1f} CPU µs/ex)")
            cases.append(case(f"loop vs model.fit, same steps_per_execution ({spe}), batch {batch} (ex/s)",
                              samples["loop"], samples["fit"], 1.0, unit="ex/s",
                              baseline_name=f"Keras 3 model.fit, steps_per_execution {spe}",
                              bound="both run the same compiled step; what differs is the per-execution Python "
                                    "around it, so per-step dispatch at small batches decides it."))
        # (b) train.jit_compile: the same loop with the step's forward and backward pass compiled by XLA.
        cases += jit_compile_cases(manifest, rows, repeats)
        # (c) 2 MWMS workers: tfdag's loop vs Keras 2 fit, on a compute-bound MLP, global batch 512.
        cases.append(_multi_worker_case(directory, manifest, rows, 1 if quick else repeats))
    return cases


def _multi_worker_case(directory: str, manifest, rows: int, repeats: int) -> dict:
    name = "2-worker MWMS: tfdag loop vs Keras 2 fit, MLP 1024x1024 (global ex/s)"
    try:
        import tf_keras  # noqa: F401  (only checks that the baseline can run)
    except ImportError:
        return not_run(name, "tf_keras is not installed (pip install -c constraints.txt -e '.[bench]')")
    hidden = [1024, 1024]
    per_worker_batch = 256
    steps = min(48, rows // (2 * per_worker_batch))  # one epoch: no epoch boundary in the window
    warmup = max(4, steps // 6)
    cpu: dict[str, list[float]] = {"tfdag": [], "keras2": []}
    samples = interleaved({
        "tfdag": _rates(lambda: _multi_worker(directory, manifest, per_worker_batch, hidden, steps, warmup, 2),
                        cpu["tfdag"]),
        "keras2": _rates(lambda: _keras2_multi_worker(directory, manifest, 2 * per_worker_batch, hidden, steps,
                                                      warmup), cpu["keras2"]),
    }, repeats)
    print(f"training MLP {hidden}, global batch {2 * per_worker_batch}, {steps} steps, 2 MWMS workers over loopback: "
          f"tfdag loop {_median(samples['tfdag']):,.0f} global ex/s (chief {_median(cpu['tfdag']):.1f} CPU µs/ex) | "
          f"Keras 2 fit {_median(samples['keras2']):,.0f} ex/s (chief {_median(cpu['keras2']):.1f} CPU µs/ex)")
    return case(name, samples["tfdag"], samples["keras2"], 1.0, unit="ex/s",
                baseline_name="tf_keras model.fit under MultiWorkerMirroredStrategy, same MLP, data and global batch",
                bound="the 1024x1024 matmuls and the ring all-reduce of every gradient over gRPC on loopback, the "
                      "same collective on both sides.")


def jit_compile_cases(manifest, rows: int, repeats: int) -> list[dict]:
    """The loop with and without `train.jit_compile`, default MLP, batch 256, one epoch (light: a few seconds)."""
    hidden, batch = [128, 64], 256
    steps = rows // batch
    warmup = max(4, steps // 4)
    spe = min(STEPS_PER_EXECUTION, steps // 4)  # several executions after the warm-up, even in a quick run
    cpu: dict[str, list[float]] = {"plain": [], "xla": []}
    samples = interleaved({
        "plain": _rates(lambda: _custom_loop(manifest, batch, hidden, steps, spe, warmup), cpu["plain"]),
        "xla": _rates(lambda: _custom_loop(manifest, batch, hidden, steps, spe, warmup, jit_compile=True),
                      cpu["xla"]),
    }, repeats)
    print(f"training batch {batch}, MLP {hidden}, {steps} steps: tfdag loop with train.jit_compile "
          f"{_median(samples['xla']):,.0f} ex/s ({_median(cpu['xla']):.1f} CPU µs/ex) | without "
          f"{_median(samples['plain']):,.0f} ex/s ({_median(cpu['plain']):.1f} CPU µs/ex)")
    return [case(f"loop jit_compile vs not, batch {batch} (ex/s)", samples["xla"], samples["plain"], JIT_TARGET,
                 unit="ex/s", baseline_name="the same loop without jit_compile",
                 bound="a regression floor: XLA on CPU launches its compiled cluster once per step and finds nothing "
                       "to fuse in a small MLP that oneDNN does not already.")]
