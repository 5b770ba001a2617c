"""Test-only fault injection into worker processes, driven by the TFDAG_FAULT environment variable.

`TFDAG_FAULT` names one fault, or several separated by commas, each of the form
`ACTION:worker=N[:step=S|:phase=P][:seconds=T]`:

- `kill:worker=1:step=30`: worker 1 sends itself SIGKILL after step 30 (a lost worker).
- `stop:worker=1:step=30`: worker 1 sends itself SIGSTOP after step 30 (a hang: alive but silent).
- `term:worker=0:step=20`: worker 0 sends itself SIGTERM after step 20 (a preemption notice).
- `raise:worker=1:step=10`: worker 1 raises `FaultInjected` after step 10 (a bug: a permanent failure).
- `kill_during_save:worker=0[:step=20]`: worker 0 sends itself SIGKILL inside a checkpoint save, after the
  checkpoint's data and index files are written but before its manifest; at the first save of a step ≥ S, or
  without `step`, at the second save of the process (so a previous checkpoint exists).
- `stop:worker=0:phase=finishing`: any action but kill_during_save may fire when the worker enters a phase
  (`starting` is entered after the restore; `saving`, `stepping`, `finishing`) instead of after a step, or at
  `phase=result`: after the final checkpoint is saved, before the result is written.
- `sleep:worker=0:phase=finishing:seconds=7`: worker 0 sleeps 7 s there (a slow phase, not a hang).

`worker` is the index among the training workers, the chief first (`ClusterInfo.worker_index`); under
parameter_server only the chief runs the step loop, so only `worker=0` fires there. A fault fires once per
run: a marker file `<run_dir>/.faults/<action>-worker<N>` is written just before it fires, so the attempt the
supervisor restarts does not fire it again. Corrupting the latest checkpoint is done by the tests on disk.
Never set TFDAG_FAULT outside tests: the worker entry loads test support (`worker_support`) only when it is set,
and adds the injector to the training loop as `FaultHooks`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
import signal
import time
from collections.abc import Mapping

from pipeline_lib.core import storage
from pipeline_lib.core.errors import TfdagError, UserError
from pipeline_lib.training.hooks import Phase, TrainHooks

logger = logging.getLogger(__name__)

FAULT_ENV = "TFDAG_FAULT"
# The fault point after the final checkpoint is saved and before the chief writes its result.
RESULT_FAULT_POINT = "result"
ACTIONS = ("kill", "stop", "term", "raise", "sleep", "kill_during_save")
MARKER_DIR = ".faults"
_POINTS = (*(p.value for p in Phase), RESULT_FAULT_POINT)
_FORMS = ("kill:worker=N:step=S, stop:worker=N:step=S, term:worker=N:step=S, raise:worker=N:step=S, "
          "sleep:worker=N:step=S:seconds=T, kill_during_save:worker=N[:step=S]; phase=P (one of "
          f"{', '.join(_POINTS)}) in place of step=S")
_CKPT_STEP = re.compile(r"ckpt-(\d+)$")


class FaultSpecError(UserError, ValueError):
    """TFDAG_FAULT cannot be parsed; the message names the value and the allowed forms."""


class FaultInjected(TfdagError, RuntimeError):
    """The exception a `raise` fault throws from inside the training loop."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: what to do, in which worker, after which step (None: see `kill_during_save`) or at which phase."""

    action: str
    worker: int
    step: int | None = None
    phase: str | None = None
    seconds: int = 0

    @property
    def marker_name(self) -> str:
        return f"{self.action}-worker{self.worker}" + (f"-{self.phase}" if self.phase else "")


def parse_faults(text: str | None, source: str = FAULT_ENV) -> tuple[Fault, ...]:
    """Parse a TFDAG_FAULT value into faults (empty or unset: none).

    Raises:
        FaultSpecError: naming the bad part, where it came from and the allowed forms.
    """
    if not text or not text.strip():
        return ()
    faults = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        action, *fields = part.split(":")
        if action not in ACTIONS:
            raise FaultSpecError(f"{source} fault {part!r}: unknown action {action!r}; allowed forms: {_FORMS}")
        values: dict[str, int] = {}
        phase = None
        for field in fields:
            key, sep, raw = field.partition("=")
            if key == "phase" and raw in _POINTS:
                phase = raw
                continue
            if not sep or key not in ("worker", "step", "seconds") or not raw.isdigit():
                raise FaultSpecError(
                    f"{source} fault {part!r}: {field!r} is not worker=N, step=S, seconds=T (N, S, T ≥ 0 integers) "
                    f"or phase=P; allowed forms: {_FORMS}")
            values[key] = int(raw)
        if "worker" not in values:
            raise FaultSpecError(f"{source} fault {part!r} has no worker=N; allowed forms: {_FORMS}")
        if action != "kill_during_save" and ("step" in values) == (phase is not None):
            raise FaultSpecError(f"{source} fault {part!r} needs either step=S or phase=P; allowed forms: {_FORMS}")
        faults.append(Fault(action=action, worker=values["worker"], step=values.get("step"), phase=phase,
                            seconds=values.get("seconds", 0)))
    return tuple(faults)


class FaultInjector:
    """Fires the faults meant for one worker, each once per run (marker files in the run dir)."""

    def __init__(self, faults: tuple[Fault, ...], worker_index: int, run_dir: str,
                 storage_options: dict | None = None):
        self.faults = tuple(f for f in faults if f.worker == worker_index)
        self.worker_index = worker_index
        self.marker_dir = storage.join(run_dir, MARKER_DIR)
        self.storage_options = storage_options
        self._saves = 0

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _claim(self, fault: Fault) -> bool:
        """Write the fault's marker; False when it already fired in an earlier attempt."""
        fs, path = storage.get_fs(storage.join(self.marker_dir, fault.marker_name), self.storage_options)
        if fs.exists(path):
            return False
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as handle:
            handle.write(str(os.getpid()).encode())
        return True

    def _fire(self, fault: Fault, where: str) -> None:
        if not self._claim(fault):
            return
        # Printed, not only logged: the fault tests read it in the launcher's prefixed log.
        print(f"tfdag fault | {fault.action} fires in worker {self.worker_index} {where}", flush=True)
        if fault.action in ("kill", "kill_during_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.action == "sleep":
            time.sleep(fault.seconds)
        elif fault.action == "raise":
            raise FaultInjected(f"TFDAG_FAULT raise:worker={fault.worker}:step={fault.step} fired {where}")

    def on_step_end(self, step: int) -> None:
        """Fire the step faults whose step has been reached."""
        for fault in self.faults:
            if fault.action != "kill_during_save" and fault.step is not None and step >= fault.step:
                self._fire(fault, f"after step {step}")

    def on_phase(self, phase: str, step: int) -> None:
        """Fire the faults of `phase`, which the worker enters at `step`."""
        for fault in self.faults:
            if fault.phase == phase and fault.action != "kill_during_save":
                self._fire(fault, f"entering phase {phase} at step {step}")

    def on_checkpoint_written(self, prefix: str) -> None:
        """Fire a kill_during_save fault: called after a checkpoint's files are written, before its manifest."""
        self._saves += 1
        match = _CKPT_STEP.search(prefix)
        step = int(match.group(1)) if match else -1
        for fault in self.faults:
            if fault.action != "kill_during_save":
                continue
            due = step >= fault.step if fault.step is not None else self._saves >= 2
            if due:
                self._fire(fault, f"while saving checkpoint {prefix}")

    def install_save_hook(self) -> None:
        """Wrap `tf.train.Checkpoint.write` in this process so kill_during_save can fire mid-save.

        The checkpoint store writes the data and index files with `Checkpoint.write` and then the manifest;
        firing right after `write` returns is exactly "data written, manifest not".
        """
        if not any(f.action == "kill_during_save" for f in self.faults):
            return
        import tensorflow as tf

        original = tf.train.Checkpoint.write
        injector = self

        def write(checkpoint, file_prefix, options=None):
            path = original(checkpoint, file_prefix, options=options)
            injector.on_checkpoint_written(str(file_prefix))
            return path

        tf.train.Checkpoint.write = write


def injector_from_env(worker_index: int, run_dir: str, environ: Mapping[str, str] | None = None,
                      storage_options: dict | None = None) -> FaultInjector | None:
    """The injector for this worker when TFDAG_FAULT names a fault for it, else None.

    Raises:
        FaultSpecError: when TFDAG_FAULT is set but malformed.
    """
    environ = os.environ if environ is None else environ
    faults = parse_faults(environ.get(FAULT_ENV))
    injector = FaultInjector(faults, worker_index, run_dir, storage_options)
    if not injector:
        return None
    logger.warning("TFDAG_FAULT is set (test-only): %s", ", ".join(f.marker_name for f in injector.faults))
    return injector


class FaultHooks(TrainHooks):
    """The training loop's hooks that fire an injector's faults: after each step, as each phase is entered
    (`starting` once the run is restored); `before_result` is the result point, for `WorkerAdditions.before_result`."""

    def __init__(self, injector: FaultInjector):
        self.injector = injector

    def on_restored(self, step: int) -> None:
        self.injector.on_phase(Phase.STARTING.value, step)

    def on_step_end(self, step: int, examples: int, loss: float) -> None:
        self.injector.on_step_end(step)

    def on_phase(self, phase: Phase, step: int) -> None:
        self.injector.on_phase(phase.value, step)

    def before_result(self, step: int) -> None:
        self.injector.on_phase(RESULT_FAULT_POINT, step)
