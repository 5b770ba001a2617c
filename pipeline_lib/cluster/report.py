"""The records of a cluster check: a Finding, the ClusterReport, the ClusterConfigError that carries them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pipeline_lib.cluster.probe import GpuInfo
from pipeline_lib.core.errors import UserError


class Finding(BaseModel):
    """One result of a cluster rule: an error stops the run, a warning is reported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Literal["error", "warning"]
    rule: str
    message: str


def error(rule: str, message: str) -> Finding:
    """A finding that stops the run."""
    return Finding(level="error", rule=rule, message=message)


def warning(rule: str, message: str) -> Finding:
    """A finding that is only reported."""
    return Finding(level="warning", rule=rule, message=message)


class ClusterConfigError(UserError, ValueError):
    """TF_CONFIG or the strategy cannot work on this cluster; the message lists every error finding."""

    def __init__(self, message: str, findings: Sequence[Finding] = (), report: ClusterReport | None = None):
        super().__init__(message)
        self.findings = tuple(findings)
        self.report = report


def format_findings(findings: Sequence[Finding], what: str = "TF_CONFIG") -> str:
    """'TF_CONFIG has 2 error(s):' and one line per finding, errors first."""
    errors = [f for f in findings if f.level == "error"]
    warnings = [f for f in findings if f.level == "warning"]
    lines = [f"{what} has {len(errors)} error(s) and {len(warnings)} warning(s):"]
    lines += [f"  - {f.level} [{f.rule}]: {f.message}" for f in errors + warnings]
    return "\n".join(lines)


class ClusterReport(BaseModel):
    """What `validate_cluster` saw: the strategy, TF_CONFIG, devices, versions and the findings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: str
    tf_config_set: bool
    task: str | None = None  # "worker 1" when TF_CONFIG is set
    cluster: dict[str, tuple[str, ...]] = {}
    num_workers: int = 1
    versions: dict[str, str]
    tf_build: dict[str, str] = {}
    devices: dict[str, tuple[str, ...]]
    gpus: tuple[GpuInfo, ...] = ()
    env: dict[str, str] = {}  # masked
    findings: tuple[Finding, ...] = ()

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == "warning")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def to_markdown(self) -> str:
        """Markdown tables for a Prefect or MLflow artifact."""
        lines = ["# Cluster report", "", "| setting | value |", "|---|---|",
                 f"| strategy | {self.strategy} |",
                 f"| TF_CONFIG | {'set: ' + str(self.task) if self.tf_config_set else 'not set'} |",
                 f"| training workers | {self.num_workers} |"]
        lines += [f"| cluster.{job} | {', '.join(addresses)} |" for job, addresses in self.cluster.items()]
        for kind, names in self.devices.items():
            lines.append(f"| {kind} devices | {len(names)} |")
        for gpu in self.gpus:
            memory = f"{gpu.memory_mb} MiB" if gpu.memory_mb is not None else "memory unknown"
            lines.append(f"| {gpu.device} | {gpu.name or 'unknown'}, {memory} |")
        lines += ["", "| package | version |", "|---|---|"]
        lines += [f"| {name} | {version} |" for name, version in {**self.versions, **self.tf_build}.items()]
        if self.env:
            lines += ["", "| environment | value |", "|---|---|"]
            lines += [f"| `{name}` | `{clip(value, 200)}` |" for name, value in self.env.items()]
        if self.findings:
            lines += ["", "## Findings", "", "| level | rule | message |", "|---|---|---|"]
            lines += [f"| {f.level} | {f.rule} | {f.message.replace('|', '/')} |" for f in self.findings]
        else:
            lines += ["", "No findings: the strategy fits this machine."]
        return "\n".join(lines) + "\n"


def clip(value: Any, limit: int = 120) -> str:
    """`value` as text (JSON where it can be), cut to `limit` characters with "..."."""
    text = value if isinstance(value, str) else json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
