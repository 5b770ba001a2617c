"""Searching every output of a pipeline run for a canary secret: Prefect (through its API), MLflow (params, tags,
metrics, every artifact file), an object store, local directories (bytes, binary files included) and text.

Each search adds the places it found the canary to `Canary.hits`; a test asserts the list is empty, so a failure
names every place at once.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Canary:
    """A unique fake secret and where it was found."""

    value: str = field(default_factory=lambda: f"CANARY-{uuid.uuid4().hex}")
    hits: list[str] = field(default_factory=list)
    searched: list[str] = field(default_factory=list)  # what was searched, for the failure message

    def text(self, where: str, text: str | bytes) -> None:
        data = text if isinstance(text, bytes) else text.encode("utf-8", errors="replace")
        self.searched.append(where)
        at = data.find(self.value.encode())
        if at >= 0:  # where, and the text around it
            around = data[max(at - 100, 0):at + len(self.value) + 40].decode("utf-8", errors="replace")
            self.hits.append(f"{where}: ...{around.replace(self.value, '<CANARY>')!r}...")

    def json(self, where: str, value: Any) -> None:
        self.text(where, json.dumps(value, default=str))

    def directory(self, where: str, root: str | Path, skip: tuple[str, ...] = (), since: float | None = None) -> int:
        """Every file under `root` (bytes), or only those changed after `since`; returns how many were read."""
        count = 0
        for base, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(base, name)
                if path in skip or os.path.islink(path):
                    continue
                try:
                    if since is not None and os.path.getmtime(path) < since:
                        continue
                    with open(path, "rb") as handle:
                        self.text(f"{where}: {os.path.relpath(path, root)}", handle.read())
                    count += 1
                except OSError:
                    pass  # a file removed while we walked (a server's journal)
        return count

    def store(self, where: str, fs: Any, root: str) -> int:
        """Every object under `root` of an fsspec filesystem (bytes)."""
        fs.invalidate_cache()
        paths = fs.find(root)
        for path in paths:
            self.text(f"{where}: {path}", fs.cat_file(path))
        return len(paths)

    def report(self) -> str:
        return (f"the canary {self.value} was found in {len(self.hits)} place(s):\n  - " + "\n  - ".join(self.hits)
                + f"\n({len(self.searched)} outputs searched)")


def temp_entries() -> set[str]:
    """The top-level entries of the system temp directory now (before/after snapshots)."""
    root = tempfile.gettempdir()
    return {os.path.join(root, name) for name in os.listdir(root)}


def search_prefect(canary: Canary, flow_run_id: str) -> dict[str, Any]:
    """The flow run (its parameters), its task runs, logs and artifacts, and the server's recent events, through
    the Prefect API. Returns the flow run's parameters."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    run_id = uuid.UUID(flow_run_id)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        canary.text("Prefect flow run (parameters, state)", flow_run.model_dump_json())
        for task_run in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))):
            canary.text(f"Prefect task run {task_run.name}", task_run.model_dump_json())
        offset = 0
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                    limit=200, offset=offset)
            for log in logs:
                canary.text(f"Prefect log line: {log.message[:80]!r}", log.model_dump_json())
            if len(logs) < 200:
                break
            offset += len(logs)
        for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))):
            canary.text(f"Prefect artifact {artifact.key or artifact.id}", artifact.model_dump_json())
        # The events of the run and its task runs: the server's event store keeps their payloads. It writes them
        # a moment after they occur: a run that ended a second ago may have none stored yet.
        for _ in range(40):
            page = client._client.post("/events/filter", json={"limit": 50, "filter": {
                "any_resource": {"id_prefix": ["prefect.flow-run.", "prefect.task-run."]},
                "occurred": {"since": flow_run.created.isoformat()}}}).json()
            if page.get("events"):
                break
            time.sleep(0.5)
        num_events = 0
        for _ in range(40):  # 50 a page
            for event in page.get("events", []):
                canary.json(f"Prefect event {event.get('event')}", event)
                num_events += 1
            if not page.get("next_page"):
                break
            page = client._client.get(page["next_page"]).json()
        assert num_events, "the Prefect server returned no event of the run"
        return dict(flow_run.parameters)


def search_mlflow(canary: Canary, tracking_uri: str, run_id: str, into: Path) -> dict[str, str]:
    """The run's params, tags, metric names and values, its dataset inputs, every artifact file (downloaded) and the
    model versions made from it. Returns the downloaded artifacts' local root."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    run = client.get_run(run_id)
    for name, value in run.data.params.items():
        canary.text(f"MLflow param {name}", f"{name}={value}")
    for name, value in run.data.tags.items():
        canary.text(f"MLflow tag {name}", f"{name}={value}")
    for name in run.data.metrics:
        history = client.get_metric_history(run_id, name)
        canary.text(f"MLflow metric {name}", json.dumps([name, [m.value for m in history]]))
    canary.text("MLflow run info and inputs", json.dumps({"info": dict(run.info), "inputs": str(run.inputs)},
                                                         default=str))
    local = client.download_artifacts(run_id, "", str(into))
    count = canary.directory("MLflow artifact", local)
    assert count > 0, f"MLflow run {run_id} has no artifact file"
    for version in client.search_model_versions(f"run_id = '{run_id}'"):
        canary.text(f"MLflow model version {version.name} v{version.version}", str(dict(version)))
    return {"artifacts": local}
