"""One flow run's lifecycle, shared by the pipeline, retrain and tune flows: its stages, its tracked run, and what a
failure leaves behind.

`tracked_run(config, ...)` yields a `RunLifecycle`; the flow calls `lifecycle("stage")` as each stage starts.
Each start and end goes to the event bus (`StageStarted`/`StageFinished`: the `tfdag run` console's checklist) and
to the stage record `<run_dir>/stages.json` (`tracking.stage_record`). The tracked run the flow started ends
FINISHED when the block returns; FAILED when it raises, naming the stage, with a Prefect failure artifact; KILLED
on Ctrl-C or a Prefect cancellation. A failed or stopped run also keeps the training tasks' logs in the tracked run.

Stopping a run at a stage boundary (tests, a resume scenario): listen on the event bus (`events.listening`) and
raise `KeyboardInterrupt` when `StageStarted(name)` arrives. The bus swallows a listener's `Exception` (a display
never stops a run) but not an interrupt: the run ends KILLED in stage `name`, the stages before it recorded
finished.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prefect import get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import TerminationSignal

from pipeline_lib.config import PipelineConfig
from pipeline_lib.core import events, storage
from pipeline_lib.tracking.stage_record import (
    SUMMARY,
    StageEntry,
    StageRecord,
    StageStatus,
    keep_result,
    read_kept,
    write_stage_record,
)
from pipeline_lib.tracking.tracker import RunStatus, TrackedRun, open_tracker
from tasks import stages
from tasks.progress import artifact_key

Result = TypeVar("Result")


class RunLifecycle:
    """The running stage, the stage record and the tracked run of one flow run."""

    def __init__(self, config: PipelineConfig | None, *, emit_events: bool = True):
        self.config = config  # None until the flow has loaded it (retrain's first stage)
        self.stage = "load_config"
        self.run: TrackedRun | None = None
        self.owns_run = True  # False: a run someone else started and ended (retrain's challenger run)
        self.run_dir: str | None = None
        self.run_name: str | None = None
        self.emit_events = emit_events
        self.earlier: StageRecord | None = None  # the record of the attempt this one resumes
        self._created = time.time()
        self._flow_run_id: str | None = None
        self._summary: str | None = None
        self._started: float | None = None
        self._entries: list[StageEntry] = []
        self._record_failed = False

    def begin(self, run_name: str, run_dir: str, earlier: StageRecord | None = None) -> None:
        """The run's name and directory, and the record of the attempt it resumes (None: a new run); the stage
        record is written now. A resumed attempt's Prefect flow run that is still RUNNING (its process died) is
        marked Crashed, so that Prefect can retry it and no one waits for it."""
        self.run_name, self.run_dir, self.earlier = run_name, run_dir, earlier
        self._flow_run_id = str(runtime.flow_run.id) if runtime.flow_run.id else None
        if earlier is not None:
            self._created = earlier.created_at or self._created
            self._entries = list(earlier.stages)
            if earlier.prefect_flow_run_id and earlier.prefect_flow_run_id != self._flow_run_id:
                _mark_crashed(earlier.prefect_flow_run_id, run_name)
        self._write_record()

    def once(self, stage: str, kind: Any, run: Callable[[], Result], *,
             verify: Callable[[Result], bool] | None = None,
             record: Callable[[Result], tuple[dict[str, str], dict[str, str]]] | None = None) -> Result:
        """Stage `stage`: the result (of type `kind`) the attempt this one resumes kept when it finished the stage and
        the result passes `verify`; otherwise the stage runs now (`run()`), its result is kept, and `record(result)`
        gives the outputs and digests the stage record lists for it."""
        if self.earlier is not None and (entry := self.earlier.finished(stage)) is not None:
            found, result = read_kept(self.run_dir, stage, entry.kept, kind, self._options)
            if found and (verify is None or verify(result)):
                get_run_logger().info("stage %s finished in an earlier attempt of run %s and its result is verified: "
                                      "not run again", stage, self.run_name)
                return result
        self(stage)
        result = run()
        if record is not None:
            self.wrote(*record(result))
        self.keep(kind, result)
        return result

    def keep(self, kind: Any, result: Any) -> None:
        """Keep the running stage's result (of type `kind`) beside the stage record, for a resumed run."""
        if self.run_dir is None or not self._entries:
            return
        digest = keep_result(self.run_dir, self.stage, result, kind, self._options)
        self._entries[-1] = self._entries[-1].model_copy(update={"kept": digest})
        self._write_record()

    def finish(self, summary: Any) -> None:
        """The run finished: its summary kept (`tfdag run --resume` of it prints it and does nothing else)."""
        if self.run_dir is None:
            return
        self._summary = keep_result(self.run_dir, SUMMARY, summary, type(summary), self._options)
        self._write_record()

    @property
    def _options(self) -> dict[str, Any]:
        return dict(self.config.storage_options) if self.config is not None else {}

    @property
    def run_id(self) -> str | None:
        return self.run.run_id if self.run is not None else None

    def __call__(self, stage: str) -> None:
        """Stage `stage` starts (the one before it finished)."""
        self.end_stage()
        self.stage, self._started = stage, time.monotonic()
        self._entries.append(StageEntry(name=stage, status=StageStatus.RUNNING, started_at=time.time()))
        self._write_record()
        if self.emit_events:
            events.emit(events.StageStarted(stage))

    def end_stage(self, status: StageStatus = StageStatus.FINISHED) -> None:
        """The running stage ended (FAILED or KILLED: it raised); the next `__call__` or nothing follows."""
        if self._started is None:
            return
        seconds = time.monotonic() - self._started
        self._started = None
        self._entries[-1] = self._entries[-1].model_copy(update={"status": status, "seconds": seconds})
        self._write_record()
        if self.emit_events:
            events.emit(events.StageFinished(self.stage, seconds, failed=status != StageStatus.FINISHED))

    def wrote(self, outputs: Mapping[str, str] | None = None, digests: Mapping[str, str] | None = None) -> None:
        """What the running stage wrote (URIs, ids) and their digests, for the stage record."""
        if not self._entries:
            return
        entry = self._entries[-1]
        self._entries[-1] = entry.model_copy(update={"outputs": {**entry.outputs, **(outputs or {})},
                                                     "digests": {**entry.digests, **(digests or {})}})
        self._write_record()

    def start_run(self, run_name: str, tags: dict[str, str]) -> TrackedRun:
        """Start the flow's tracked run (the `start_tracking_run` task), or reopen the one of the attempt this one
        resumes (back to RUNNING): it ends with the lifecycle."""
        assert self.config is not None
        earlier_id = self.earlier.tracking_run_id if self.earlier is not None else None
        if earlier_id:
            self("reopen_tracking_run")
            stages.reopen_tracking_run(self.config, earlier_id)
            run_id = earlier_id
        else:
            self("start_tracking_run")
            run_id = stages.start_tracking_run(self.config, run_name, tags)
        self.run, self.owns_run = open_tracker(self.config).get_run(run_id), True
        self.wrote({"tracking_run_id": run_id})
        return self.run

    def adopt_run(self, run_id: str | None) -> None:
        """A run another flow started and ended (a subflow's): ended again here only when this flow fails."""
        if run_id is not None and self.config is not None:
            self.run, self.owns_run = open_tracker(self.config).get_run(run_id), False

    @contextlib.contextmanager
    def nested_run(self, run: TrackedRun | None) -> Iterator[None]:
        """A second run the block works in (tune's best model): FINISHED when it returns, else FAILED (KILLED on an
        interrupt) in the running stage."""
        if run is None or self.config is None:
            yield
            return
        try:
            yield
        except (KeyboardInterrupt, TerminationSignal):
            self._end_run(run, RunStatus.KILLED)
            raise
        except Exception:
            self._end_run(run, RunStatus.FAILED)
            raise
        stages.finish_tracking_run(self.config, run.run_id, RunStatus.FINISHED)

    def keep_task_logs(self) -> None:
        """The training tasks' logs (`<run_dir>/logs/`) as the run's artifacts `logs/`, so a failed worker's
        traceback survives its process. Best effort: the error that stopped the run is the one to report."""
        if self.run is None or self.run_dir is None or self.config is None:
            return
        logs = storage.join(self.run_dir, "logs")
        try:
            fs, path = storage.get_fs(logs, self.config.storage_options)
            if fs.exists(path):
                self.run.log_artifacts({"logs": logs})
        except Exception as error:  # noqa: BLE001 - see the docstring
            get_run_logger().warning("task logs not logged to MLflow run %s: %s", self.run.run_id, error)

    def _end_run(self, run: TrackedRun | None, status: RunStatus) -> None:
        """End a run FAILED or KILLED in the running stage; an error doing so is logged, not raised (the error
        that stopped the flow is the one to report)."""
        if run is None or self.config is None:
            return
        try:
            stages.finish_tracking_run(self.config, run.run_id, status, self.stage)
        except Exception as error:  # noqa: BLE001 - see the docstring
            get_run_logger().warning("MLflow run %s could not be ended %s: %s", run.run_id, status.value, error)

    def _write_record(self) -> None:
        if self.run_dir is None or self.config is None:
            return
        record = StageRecord(pipeline=self.config.name, run_name=self.run_name, tracking_run_id=self.run_id,
                             created_at=self._created, prefect_flow_run_id=self._flow_run_id,
                             config=self.config.model_dump(mode="json"), host=socket.gethostname(), pid=os.getpid(),
                             summary=self._summary, stages=tuple(self._entries))
        try:
            write_stage_record(self.run_dir, record, self.config.storage_options)
        except Exception as error:  # noqa: BLE001 - the stage's own error (storage) is the one to report
            if not self._record_failed:
                get_run_logger().warning("stage record not written to %s: %s", self.run_dir, error)
            self._record_failed = True


def _mark_crashed(flow_run_id: str, run_name: str) -> None:
    """Mark a flow run whose process died Crashed when Prefect still has it running (best effort)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and not state.is_final():
                client.set_flow_run_state(flow_run_id, Crashed(message=f"its process ended without a final state; run "
                                                                       f"{run_name} was resumed by another flow run"),
                                          force=True)
    except Exception as error:  # noqa: BLE001 - the resumed run goes on either way
        get_run_logger().warning("flow run %s not marked Crashed: %s", flow_run_id, error)


@contextlib.contextmanager
def tracked_run(config: PipelineConfig | None, *, subject: str | None = None, heading: str | None = None,
                failure_key: str | None = None, finish_stage: bool = True,
                emit_events: bool = True) -> Iterator[RunLifecycle]:
    """The lifecycle of one flow run (see the module docstring).

    Args:
        config: the pipeline config (its tracking store); None: the flow loads it in the block and sets
            `lifecycle.config` (then `subject`, `heading` and `failure_key` are needed).
        subject: how log lines name the run (default: `pipeline '<name>'`).
        heading: the failure artifact's heading (default: "Pipeline `<name>`").
        failure_key: the failure artifact's key (default: `<name>-failure`).
        finish_stage: end a successful run in a stage of its own, `finish_tracking_run`.
        emit_events: send stage starts and ends to the event bus.
    """
    lifecycle = RunLifecycle(config, emit_events=emit_events)
    if config is None and not (subject and heading and failure_key):
        raise ValueError("tracked_run(None, ...) needs subject, heading and failure_key")
    subject = subject or f"pipeline {config.name!r}"  # type: ignore[union-attr]
    logger = get_run_logger()
    try:
        yield lifecycle
        if finish_stage:
            lifecycle("finish_tracking_run")
        if lifecycle.run is not None and lifecycle.owns_run and lifecycle.config is not None:
            stages.finish_tracking_run(lifecycle.config, lifecycle.run.run_id, RunStatus.FINISHED)
        lifecycle.end_stage()
    except (KeyboardInterrupt, TerminationSignal):
        lifecycle.end_stage(StageStatus.KILLED)
        logger.error("%s stopped in stage %s", subject, lifecycle.stage)
        lifecycle.keep_task_logs()
        lifecycle._end_run(lifecycle.run, RunStatus.KILLED)
        raise
    except Exception as error:
        lifecycle.end_stage(StageStatus.FAILED)
        create_markdown_artifact(
            f"# {heading or f'Pipeline `{config.name}`'} failed\n\n**Stage:** `{lifecycle.stage}`\n\n**Error:**\n\n"
            f"```\n{error}\n```\n",
            key=failure_key or artifact_key(f"{config.name}-failure"),
            description=f"failed in stage {lifecycle.stage}",
        )
        logger.error("%s failed in stage %s: %s", subject, lifecycle.stage, error)
        lifecycle.keep_task_logs()
        lifecycle._end_run(lifecycle.run, RunStatus.FAILED)
        raise
