"""The preflight's outcome: the PreflightReport and PreflightError, and the table cells both show per task."""

from __future__ import annotations

import collections
import hashlib
import json

from pydantic import BaseModel, ConfigDict

from pipeline_lib.cluster.fingerprint import COMPARED_VERSIONS, Fingerprint
from pipeline_lib.cluster.probe import GpuInfo
from pipeline_lib.core.errors import TfdagError


class PreflightError(TfdagError, RuntimeError):
    """The cluster's tasks differ, a peer is missing or unreachable, or two tasks claim one slot."""

    def __init__(self, message: str, report: PreflightReport | None = None):
        super().__init__(message)
        self.report = report


class PreflightReport(BaseModel):
    """The preflight as one task saw it: every fingerprint, the warnings, the errors and the peers checked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str
    passed: bool
    fingerprints: tuple[Fingerprint, ...]
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    reachable: dict[str, str] = {}  # "worker 1" -> "127.0.0.1:2223"

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def to_markdown(self) -> str:
        """One column per task: versions, hashes, GPUs, then the warnings and errors."""
        tasks = [f.task for f in self.fingerprints]
        lines = [f"# Preflight ({'passed' if self.passed else 'failed'}, reported by {self.task})", "",
                 "| field | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
        for field, _fix in compared_fields():
            values = [cell(field, field_value(f, field)) for f in self.fingerprints]
            lines.append(f"| {field} | " + " | ".join(values) + " |")
        for key in ("cuda_version", "cudnn_version"):
            lines.append(f"| {key} | " + " | ".join(f.tf_build.get(key, "") for f in self.fingerprints) + " |")
        lines.append("| GPUs | " + " | ".join(gpu_words(f.gpus) for f in self.fingerprints) + " |")
        lines.append("| host | " + " | ".join(f.host for f in self.fingerprints) + " |")
        if self.reachable:
            lines += ["", "Reachable peers: " + ", ".join(f"{t} ({a})" for t, a in self.reachable.items())]
        if self.warnings:
            lines += ["", "## Warnings", ""] + [f"- {w}" for w in self.warnings]
        if self.errors:
            lines += ["", "## Errors", ""] + ["```\n" + e + "\n```" for e in self.errors]
        return "\n".join(lines) + "\n"


def compared_fields() -> list[tuple[str, str]]:
    """(field, fix) for every field all tasks must agree on."""
    fields = [(name, f"install the same {name} version on every node (one container image for every task)")
              for name in COMPARED_VERSIONS]
    fields[0] = ("python", "use the same Python version on every node (one container image for every task)")
    return fields + [
        ("config_hash", "every task must run the same pipeline config (the same worker spec)"),
        ("data_hash", "every task must read the same dataset manifest (the same dataset_uri)"),
        ("cluster", "every task needs the same TF_CONFIG cluster; regenerate TF_CONFIG from one source"),
    ]


def field_value(fingerprint: Fingerprint, field: str) -> str:
    """The text of one compared field of a fingerprint."""
    if field in COMPARED_VERSIONS:
        return fingerprint.versions.get(field, "")
    if field == "cluster":
        return json.dumps(fingerprint.cluster, sort_keys=True)
    return getattr(fingerprint, field)


def cell(field: str, value: str, width: int = 12) -> str:
    """A field's value as a table cell: hashes shortened, the cluster as a short digest."""
    if field in ("config_hash", "data_hash"):
        return value[:width] if value else "(none)"
    if field == "cluster":
        return "#" + hashlib.sha256(value.encode()).hexdigest()[:8]
    return value


def gpu_words(gpus: tuple[GpuInfo, ...]) -> str:
    """'2× NVIDIA H200 (143771 MiB)', or 'none'."""
    if not gpus:
        return "none"
    counts = collections.Counter(
        f"{g.name or 'unknown GPU'} ({g.memory_mb} MiB)" if g.memory_mb is not None else (g.name or "unknown GPU")
        for g in gpus)
    return ", ".join(f"{n}× {name}" for name, n in counts.items())
