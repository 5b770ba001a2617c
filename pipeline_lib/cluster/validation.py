"""The distributed state of one process (TF_CONFIG parsed once into a frozen value), the TF_CONFIG rules and the cluster report."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pipeline_lib.config import PipelineConfig, Strategy
from pipeline_lib.core.errors import UserError

logger = logging.getLogger(__name__)

WORKER_JOBS = ("chief", "worker")


class ClusterInfo(BaseModel):
    """Task type and index of this process plus the cluster it belongs to.

    A process without TF_CONFIG is a single worker that is its own chief.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_type: str = "worker"
    task_index: int = 0
    cluster: dict[str, tuple[str, ...]] = {}

    @property
    def num_workers(self) -> int:
        """Training workers: the chief plus the workers (parameter servers and evaluators excluded)."""
        count = sum(len(self.cluster.get(job, ())) for job in WORKER_JOBS)
        return max(count, 1)

    @property
    def worker_index(self) -> int:
        """Index among the training workers, the chief first."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return len(self.cluster.get("chief", ())) + self.task_index
        return -1

    @property
    def is_chief(self) -> bool:
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and not self.cluster.get("chief")

    @property
    def is_multi_worker(self) -> bool:
        return self.num_workers > 1 or bool(self.cluster.get("ps"))

    @property
    def has_ps(self) -> bool:
        return bool(self.cluster.get("ps"))

    @property
    def name(self) -> str:
        """'worker 1', 'chief 0', 'ps 0': how logs and errors name this task."""
        return f"{self.task_type} {self.task_index}"

    def to_tf_config(self) -> str:
        return json.dumps({"cluster": {k: list(v) for k, v in self.cluster.items()},
                           "task": {"type": self.task_type, "index": self.task_index}})


def cluster_from_env(environ: dict[str, str] | None = None) -> ClusterInfo:
    """Parse TF_CONFIG from the environment (already validated by the cluster rules)."""
    text = (environ if environ is not None else os.environ).get("TF_CONFIG", "").strip()
    if not text:
        return ClusterInfo()
    data = json.loads(text)
    task = data.get("task", {})
    return ClusterInfo(
        task_type=task.get("type", "worker"),
        task_index=int(task.get("index", 0)),
        cluster={k: tuple(v) for k, v in data.get("cluster", {}).items()},
    )


def worker_scratch_dir(base_dir: str, cluster: ClusterInfo) -> str:
    """Where this task writes: the real directory for the chief, a private scratch one otherwise.

    TensorFlow's multi-worker checkpoint pattern: every worker must take part in a save,
    but only the chief's copy is kept.
    """
    if cluster.is_chief:
        return base_dir
    return os.path.join(base_dir, ".scratch", f"{cluster.task_type}-{cluster.task_index}")


@contextlib.contextmanager
def scratch_cleanup(path: str, cluster: ClusterInfo) -> Iterator[str]:
    """Yield a worker's write directory and remove it afterwards when it is a scratch one."""
    try:
        yield path
    finally:
        if not cluster.is_chief:
            shutil.rmtree(path, ignore_errors=True)


def chief_only(cluster: ClusterInfo, fn, *args, **kwargs):
    """Call fn only on the chief; other tasks get None."""
    return fn(*args, **kwargs) if cluster.is_chief else None


# --- TF_CONFIG rules (issue 4 §1) -------------------------------------------------------------------------

KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
SECRET_MARKERS = ("KEY", "SECRET", "TOKEN", "PASSWORD")
MASK = "***"
_LOCAL_STRATEGIES = (Strategy.DEFAULT, Strategy.ONE_DEVICE, Strategy.MIRRORED)


class Finding(BaseModel):
    """One result of a cluster rule: an error stops the run, a warning is reported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: Literal["error", "warning"]
    rule: str
    message: str


class ClusterConfigError(UserError, ValueError):
    """TF_CONFIG or the strategy cannot work on this cluster; the message lists every error finding."""

    def __init__(self, message: str, findings: Sequence[Finding] = (), report: ClusterReport | None = None):
        super().__init__(message)
        self.findings = tuple(findings)
        self.report = report


@dataclasses.dataclass(frozen=True)
class _TfConfig:
    """What the rules look at: the raw text plus whatever parts of it parsed."""

    text: str
    source: str
    strategy: Strategy
    data: Any = None  # the decoded JSON (any type), None when it is not JSON
    parse_error: str | None = None

    @property
    def cluster(self) -> dict[str, Any] | None:
        value = self.data.get("cluster") if isinstance(self.data, dict) else None
        return value if isinstance(value, dict) else None

    @property
    def task(self) -> dict[str, Any] | None:
        value = self.data.get("task") if isinstance(self.data, dict) else None
        return value if isinstance(value, dict) else None

    @property
    def jobs(self) -> dict[str, list[Any]]:
        """The cluster's jobs whose value is a list."""
        return {k: v for k, v in (self.cluster or {}).items() if isinstance(v, list)}

    @property
    def who(self) -> str:
        """'TF_CONFIG of worker 1' when the task parses, else just the source."""
        task = self.task or {}
        kind, index = task.get("type"), task.get("index")
        if isinstance(kind, str) and isinstance(index, int) and not isinstance(index, bool):
            return f"{self.source} of {kind} {index}"
        return self.source

    def count(self, *jobs: str) -> int:
        return sum(len(self.jobs.get(job, [])) for job in jobs)


def _error(rule: str, message: str) -> Finding:
    return Finding(level="error", rule=rule, message=message)


def _warning(rule: str, message: str) -> Finding:
    return Finding(level="warning", rule=rule, message=message)


def split_address(address: str) -> tuple[str, str | None]:
    """('host', 'port') of 'host:port' or '[v6]:port'; port None when there is none (port stays a string)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else (address, None)


def _addresses(tf: _TfConfig) -> list[tuple[str, int, Any]]:
    return [(job, i, a) for job, addresses in tf.jobs.items() for i, a in enumerate(addresses)]


def rule_not_json(tf: _TfConfig) -> list[Finding]:
    if tf.parse_error is not None:
        return [_error("not_json", f"{tf.source} is not valid JSON ({tf.parse_error}): {_clip(tf.text)!r}; write it "
                                   'as {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
                                   '"index": 0}}')]
    if not isinstance(tf.data, dict):
        return [_error("not_json", f"{tf.source} holds a JSON {type(tf.data).__name__}, not an object: "
                                   f"{_clip(tf.text)!r}; write it as an object with 'cluster' and 'task' keys")]
    return []


def rule_missing_cluster(tf: _TfConfig) -> list[Finding]:
    if "cluster" not in tf.data:
        return [_error("missing_cluster", f"{tf.who} has no 'cluster' key (keys: {sorted(tf.data)}); add "
                                          '"cluster": {"worker": ["host:port", ...]} listing every task')]
    if tf.cluster is None:
        return [_error("missing_cluster", f"{tf.who}: 'cluster' is {_show(tf.data['cluster'])}, not an object; "
                                          'write it as {"worker": ["host:port", ...]}')]
    return []


def rule_missing_task(tf: _TfConfig) -> list[Finding]:
    if "task" not in tf.data:
        return [_error("missing_task", f"{tf.source} has no 'task' key (keys: {sorted(tf.data)}); add "
                                       '"task": {"type": "worker", "index": N} naming this process')]
    task = tf.task
    if task is None:
        return [_error("missing_task", f"{tf.source}: 'task' is {_show(tf.data['task'])}, not an object; write it "
                                       'as {"type": "worker", "index": N}')]
    missing = [key for key in ("type", "index") if key not in task]
    if missing:
        return [_error("missing_task", f"{tf.source}: task {task} lacks {' and '.join(map(repr, missing))}; every "
                                       'process needs its own {"type": ..., "index": ...}')]
    return []


def rule_unknown_job(tf: _TfConfig) -> list[Finding]:
    return [
        _error("unknown_job", f"{tf.who} lists an unknown job {job!r} in cluster; allowed jobs are "
                              f"{', '.join(KNOWN_JOBS)}; rename it (a coordinator is 'chief', a server 'ps')")
        for job in (tf.cluster or {}) if job not in KNOWN_JOBS
    ]


def rule_empty_job(tf: _TfConfig) -> list[Finding]:
    found = []
    for job, value in (tf.cluster or {}).items():
        if not isinstance(value, list):
            found.append(_error("empty_job", f"{tf.who}: cluster.{job} is {_show(value)}, not a list of "
                                             f"addresses; write it as [\"host:port\", ...]"))
        elif not value:
            found.append(_error("empty_job", f"{tf.who}: cluster.{job} is an empty list; list its tasks' "
                                             f"host:port addresses or remove the job"))
    return found


def rule_address_without_port(tf: _TfConfig) -> list[Finding]:
    found = []
    for job, index, address in _addresses(tf):
        if not isinstance(address, str):
            found.append(_error("address_without_port", f"{tf.who}: cluster.{job}[{index}] is {address!r}, not a "
                                                        "'host:port' string; quote it as \"host:port\""))
            continue
        host, port = split_address(address)
        if port is None or not host:
            part = "port" if port is None else "host"
            found.append(_error("address_without_port", f"{tf.who}: cluster.{job}[{index}] {address!r} has no "
                                                        f"{part}; write it as host:port, e.g. "
                                                        f"'{host or 'worker-0'}:{port or 2222}'"))
    return found


def rule_port_not_numeric(tf: _TfConfig) -> list[Finding]:
    found = []
    for job, index, address in _addresses(tf):
        if isinstance(address, str):
            host, port = split_address(address)
            if port is not None and not port.isdigit():
                found.append(_error("port_not_numeric", f"{tf.who}: cluster.{job}[{index}] {address!r} has port "
                                                        f"{port!r}, not a number; use a numeric port, e.g. "
                                                        f"'{host}:2222'"))
    return found


def rule_port_out_of_range(tf: _TfConfig) -> list[Finding]:
    found = []
    for job, index, address in _addresses(tf):
        if isinstance(address, str):
            _host, port = split_address(address)
            if port is not None and port.isdigit() and not 1 <= int(port) <= 65535:
                found.append(_error("port_out_of_range", f"{tf.who}: cluster.{job}[{index}] {address!r} has port "
                                                         f"{int(port)}, outside 1..65535; choose a real port (0 "
                                                         "would pick a random one that peers cannot know)"))
    return found


def rule_duplicate_address(tf: _TfConfig) -> list[Finding]:
    seen: dict[str, str] = {}
    found = []
    for job, index, address in _addresses(tf):
        if not isinstance(address, str):
            continue
        slot = f"{job}[{index}]"
        if address in seen:
            found.append(_error("duplicate_address", f"{tf.who}: cluster.{slot} and cluster.{seen[address]} both "
                                                     f"use {address!r}; give every task its own host:port"))
        else:
            seen[address] = slot
    return found


def rule_task_type_not_in_cluster(tf: _TfConfig) -> list[Finding]:
    task, cluster = tf.task, tf.cluster
    if task is None or cluster is None or "type" not in task:
        return []
    kind = task["type"]
    if kind not in cluster:
        return [_error("task_type_not_in_cluster", f"{tf.source}: task.type {kind!r} is not a job of the cluster "
                                                   f"(jobs: {sorted(cluster)}); set task.type to one of them or "
                                                   f"add cluster.{kind}")]
    return []


def _index(tf: _TfConfig) -> Any:
    return (tf.task or {}).get("index")


def rule_task_index_not_integer(tf: _TfConfig) -> list[Finding]:
    task = tf.task
    if task is None or "index" not in task:
        return []
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        return [_error("task_index_not_integer", f"{tf.source}: task.index of {task.get('type')!r} is {index!r} "
                                                 f"({type(index).__name__}), not an integer; write a JSON number, "
                                                 f"e.g. \"index\": 0")]
    return []


def rule_task_index_negative(tf: _TfConfig) -> list[Finding]:
    index = _index(tf)
    if isinstance(index, int) and not isinstance(index, bool) and index < 0:
        return [_error("task_index_negative", f"{tf.source}: task.index of {tf.task.get('type')!r} is {index}; "
                                              "indices count from 0")]
    return []


def rule_task_index_out_of_range(tf: _TfConfig) -> list[Finding]:
    task, index = tf.task, _index(tf)
    if task is None or not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return []
    addresses = tf.jobs.get(task.get("type"))
    if addresses and index >= len(addresses):
        return [_error("task_index_out_of_range", f"{tf.who}: task.index {index} is out of range: "
                                                  f"cluster.{task['type']} has {len(addresses)} task(s) "
                                                  f"(indices 0..{len(addresses) - 1}); fix the index or add the "
                                                  "missing address")]
    return []


def rule_multiple_chiefs(tf: _TfConfig) -> list[Finding]:
    chiefs = tf.jobs.get("chief", [])
    if len(chiefs) > 1:
        return [_error("multiple_chiefs", f"{tf.who}: cluster.chief lists {len(chiefs)} tasks {chiefs}; a cluster "
                                          "has at most one chief: keep one and move the others to cluster.worker")]
    return []


def rule_multiple_evaluators(tf: _TfConfig) -> list[Finding]:
    evaluators = tf.jobs.get("evaluator", [])
    if len(evaluators) > 1:
        return [_error("multiple_evaluators", f"{tf.who}: cluster.evaluator lists {len(evaluators)} tasks "
                                              f"{evaluators}; TensorFlow supports one evaluator: keep one")]
    return []


def _effective(tf: _TfConfig) -> Strategy:
    """`auto` resolved as the strategy module does from the cluster alone."""
    if tf.strategy != Strategy.AUTO:
        return tf.strategy
    if tf.jobs.get("ps"):
        return Strategy.PARAMETER_SERVER
    if tf.count("chief", "worker") > 1:
        return Strategy.MULTI_WORKER_MIRRORED
    return Strategy.AUTO


def rule_ps_without_ps_job(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("ps"):
        return [_error("ps_without_ps_job", f"{tf.who}: strategy 'parameter_server' but the cluster has no 'ps' "
                                            f"job (jobs: {sorted(tf.cluster)}); add cluster.ps with at least one "
                                            "host:port or choose multi_worker_mirrored")]
    return []


def rule_ps_without_coordinator(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("chief"):
        return [_error("ps_without_coordinator", f"{tf.who}: strategy 'parameter_server' needs a coordinator, but "
                                                 f"the cluster has no 'chief' job (jobs: {sorted(tf.cluster)}); add "
                                                 "cluster.chief with the coordinator's host:port")]
    return []


def rule_ps_without_workers(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and _effective(tf) == Strategy.PARAMETER_SERVER and not tf.jobs.get("worker"):
        return [_error("ps_without_workers", f"{tf.who}: strategy 'parameter_server' needs at least one 'worker' "
                                             f"task to run steps, but the cluster has none (jobs: "
                                             f"{sorted(tf.cluster)}); add cluster.worker")]
    return []


def rule_ps_under_multi_worker_mirrored(tf: _TfConfig) -> list[Finding]:
    if tf.strategy == Strategy.MULTI_WORKER_MIRRORED and tf.jobs.get("ps"):
        return [_error("ps_under_multi_worker_mirrored", f"{tf.who}: cluster.ps lists {len(tf.jobs['ps'])} "
                                                         "parameter server(s) but strategy "
                                                         "'multi_worker_mirrored' does not use any; remove "
                                                         "cluster.ps or choose strategy 'parameter_server'")]
    return []


def rule_single_task_multi_worker(tf: _TfConfig) -> list[Finding]:
    if tf.cluster is not None and tf.strategy == Strategy.MULTI_WORKER_MIRRORED and tf.count("chief", "worker") == 1:
        return [_error("single_task_multi_worker", f"{tf.who}: strategy 'multi_worker_mirrored' but the cluster has "
                                                   "a single training task; list every worker in cluster.worker, "
                                                   "or use strategy 'mirrored' (or 'auto') on one machine")]
    return []


def rule_tf_config_with_local_strategy(tf: _TfConfig) -> list[Finding]:
    if tf.strategy in _LOCAL_STRATEGIES:
        return [_warning("tf_config_with_local_strategy", f"{tf.who} is set but strategy {tf.strategy.value!r} "
                                                          "trains on this machine only and ignores it; unset "
                                                          "TF_CONFIG or choose multi_worker_mirrored / "
                                                          "parameter_server")]
    return []


# The rules run in this order; those after `not_json` see a JSON object.
TF_CONFIG_RULES: tuple[Callable[[_TfConfig], list[Finding]], ...] = (
    rule_missing_cluster,
    rule_missing_task,
    rule_unknown_job,
    rule_empty_job,
    rule_address_without_port,
    rule_port_not_numeric,
    rule_port_out_of_range,
    rule_duplicate_address,
    rule_task_type_not_in_cluster,
    rule_task_index_not_integer,
    rule_task_index_negative,
    rule_task_index_out_of_range,
    rule_multiple_chiefs,
    rule_multiple_evaluators,
    rule_ps_without_ps_job,
    rule_ps_without_coordinator,
    rule_ps_without_workers,
    rule_ps_under_multi_worker_mirrored,
    rule_single_task_multi_worker,
    rule_tf_config_with_local_strategy,
)


def _clip(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    """A decoded JSON value as JSON text (strings in double quotes), clipped."""
    return _clip(json.dumps(value))


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_strategy(strategy: Strategy | str, source: str = "--strategy") -> Strategy:
    """A Strategy from its enum or its value.

    Raises:
        ClusterConfigError: for an unknown name, listing the allowed ones.
    """
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return Strategy(str(strategy))
    except ValueError:
        allowed = ", ".join(s.value for s in Strategy)
        raise ClusterConfigError(f"{source} ({strategy!r}) is not a strategy; use one of {allowed}") from None


def check_tf_config(text: str, strategy: Strategy | str, source: str = "TF_CONFIG") -> list[Finding]:
    """Run every TF_CONFIG rule and return the findings (errors and warnings), without raising.

    Args:
        text: the TF_CONFIG JSON text.
        strategy: the strategy the cluster is for (`train.strategy`).
        source: how messages name the text: "TF_CONFIG", a file name, "--tf-config".

    Returns:
        The findings in rule order; an empty list for a valid TF_CONFIG.
    """
    kind = parse_strategy(strategy)
    try:
        parsed = _TfConfig(text=text, source=source, strategy=kind, data=json.loads(text))
    except (json.JSONDecodeError, TypeError) as error:
        parsed = _TfConfig(text=str(text), source=source, strategy=kind, parse_error=str(error))
    findings = rule_not_json(parsed)
    if findings:
        return findings
    for rule in TF_CONFIG_RULES:
        findings.extend(rule(parsed))
    return findings


def format_findings(findings: Sequence[Finding], what: str = "TF_CONFIG") -> str:
    """'TF_CONFIG has 2 error(s):' and one line per finding, errors first."""
    errors = [f for f in findings if f.level == "error"]
    warnings = [f for f in findings if f.level == "warning"]
    lines = [f"{what} has {len(errors)} error(s) and {len(warnings)} warning(s):"]
    lines += [f"  - {f.level} [{f.rule}]: {f.message}" for f in errors + warnings]
    return "\n".join(lines)


def validate_tf_config(text: str, strategy: Strategy | str, source: str = "TF_CONFIG") -> list[Finding]:
    """Like `check_tf_config`, but raise when any finding is an error.

    Returns:
        The warnings.

    Raises:
        ClusterConfigError: listing every error (and warning) finding.
    """
    findings = check_tf_config(text, strategy, source)
    if any(f.level == "error" for f in findings):
        raise ClusterConfigError(format_findings(findings, source), findings)
    return findings


# --- environment, versions and devices ---------------------------------------------------------------------

def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of names containing KEY, SECRET, TOKEN or PASSWORD replaced by ***."""
    return {name: (MASK if is_secret_name(name) else value) for name, value in env.items()}


def relevant_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `TF_*`, `XLA_FLAGS` and `CUDA_VISIBLE_DEVICES` variables, masked, sorted by name."""
    environ = os.environ if environ is None else environ
    picked = {k: v for k, v in environ.items()
              if k.startswith("TF_") or k in ("XLA_FLAGS", "CUDA_VISIBLE_DEVICES")}
    return mask_env(dict(sorted(picked.items())))


_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
                   "tf-nightly"),
    "keras": ("keras", "keras-nightly"),
    "protobuf": ("protobuf",),
    "numpy": ("numpy",),
    "tfdag": ("tfdag",),
    "prefect": ("prefect",),
}


def package_versions(names: Sequence[str] = ("tensorflow", "keras", "protobuf", "numpy", "tfdag", "prefect")
                     ) -> dict[str, str]:
    """Python and package versions from the installed metadata (no package is imported).

    A package that is not installed reads "not installed".
    """
    versions = {"python": platform.python_version()}
    for name in names:
        found = "not installed"
        for distribution in _DISTRIBUTIONS.get(name, (name,)):
            try:
                found = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        versions[name] = found
    return versions


class GpuInfo(BaseModel):
    """A visible GPU: TensorFlow's device name, its model and total memory (None where unknown)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    name: str | None = None
    memory_mb: int | None = None


def _nvidia_smi_gpus() -> list[tuple[str, int]]:
    """(name, memory MiB) per GPU from nvidia-smi, in its index order; [] without it."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        output = subprocess.run([binary, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in output.strip().splitlines():
        name, _, memory = line.rpartition(",")
        try:
            rows.append((name.strip(), int(float(memory.strip()))))
        except ValueError:
            continue
    return rows


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[GpuInfo, ...]:
    """The GPUs TensorFlow sees, without initialising its runtime (logical devices can still be set)."""
    import tensorflow as tf

    devices = tf.config.list_physical_devices("GPU")
    if not devices:
        return ()
    smi = _nvidia_smi_gpus()
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    order = list(range(len(smi)))
    if visible.strip():
        wanted = [int(part) for part in visible.split(",") if part.strip().isdigit()]
        if len(wanted) == len([p for p in visible.split(",") if p.strip()]):
            order = [i for i in wanted if i < len(smi)]
    found = []
    for position, device in enumerate(devices):
        try:
            name = tf.config.experimental.get_device_details(device).get("device_name")
        except (RuntimeError, ValueError):  # pragma: no cover - depends on the driver
            name = None
        memory = None
        if position < len(order):
            smi_name, memory = smi[order[position]]
            name = name or smi_name
        found.append(GpuInfo(device=device.name, name=name, memory_mb=memory))
    return tuple(found)


def tf_build_info() -> dict[str, str]:
    """CUDA and cuDNN versions TensorFlow was built with (tf.sysconfig.get_build_info()), as strings."""
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    keys = ("cuda_version", "cudnn_version", "is_cuda_build", "is_rocm_build")
    return {key: str(info.get(key, "")) for key in keys}


def visible_devices() -> dict[str, tuple[str, ...]]:
    """Physical device names by type (CPU, GPU, TPU); listing them does not initialise TensorFlow."""
    import tensorflow as tf

    return {kind: tuple(d.name for d in tf.config.list_physical_devices(kind)) for kind in ("CPU", "GPU", "TPU")}


# --- the single-machine report (issue 2) --------------------------------------------------------------------

TPU_ADDRESS_ENV = ("TPU_NAME", "TPU_ADDRESS", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES")


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
            lines += [f"| `{name}` | `{_clip(value, 200)}` |" for name, value in self.env.items()]
        if self.findings:
            lines += ["", "## Findings", "", "| level | rule | message |", "|---|---|---|"]
            lines += [f"| {f.level} | {f.rule} | {f.message.replace('|', '/')} |" for f in self.findings]
        else:
            lines += ["", "No findings: the strategy fits this machine."]
        return "\n".join(lines) + "\n"


def _device_findings(config: PipelineConfig, devices: dict[str, tuple[str, ...]], environ: Mapping[str, str],
                     cluster: ClusterInfo | None) -> list[Finding]:
    train = config.train
    kind = train.strategy
    num_gpus = len(devices.get("GPU", ()))
    found: list[Finding] = []
    if kind in (Strategy.ONE_DEVICE, Strategy.MIRRORED) and num_gpus == 0 and not train.cpu_replicas:
        found.append(_error("no_gpu_for_strategy", f"train.strategy {kind.value!r} asks for GPUs but this machine "
                                                   "has none visible (CUDA_VISIBLE_DEVICES="
                                                   f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); set "
                                                   "train.cpu_replicas (e.g. 2) to use logical CPU devices, or "
                                                   "train.strategy: auto"))
    if kind == Strategy.MIRRORED and train.cpu_replicas and num_gpus:
        found.append(_warning("cpu_replicas_with_gpus", f"train.cpu_replicas ({train.cpu_replicas}) mirrors over CPU "
                                                        f"devices although {num_gpus} GPU(s) are visible; unset "
                                                        "train.cpu_replicas to train on the GPUs"))
    if kind == Strategy.TPU and not devices.get("TPU") and not any(environ.get(n) for n in TPU_ADDRESS_ENV):
        found.append(_error("no_tpu", "train.strategy 'tpu' but no TPU device is visible and none of "
                                      f"{', '.join(TPU_ADDRESS_ENV)} is set; run on a TPU VM, set TPU_NAME to the "
                                      "TPU's name or grpc:// address, or choose another strategy"))
    if cluster is None:
        if kind == Strategy.PARAMETER_SERVER and train.parameter_servers < 1:
            found.append(_error("no_parameter_servers", "train.strategy 'parameter_server' without TF_CONFIG needs "
                                                        "train.parameter_servers ≥ 1 so the launcher starts them "
                                                        "(train.parameter_servers is 0); set it, or choose another "
                                                        "strategy"))
        if kind == Strategy.MULTI_WORKER_MIRRORED and train.workers == 1:
            found.append(_warning("multi_worker_single_worker", "train.strategy 'multi_worker_mirrored' with "
                                                                "train.workers 1 and no TF_CONFIG trains as a single "
                                                                "worker; set train.workers or use 'auto'"))
        return found
    uses_ps = kind == Strategy.PARAMETER_SERVER or (kind == Strategy.AUTO and cluster.has_ps)
    if uses_ps:
        counts = {"worker": (len(cluster.cluster.get("worker", ())), train.workers, "train.workers"),
                  "ps": (len(cluster.cluster.get("ps", ())), train.parameter_servers, "train.parameter_servers")}
    elif kind not in _LOCAL_STRATEGIES:
        counts = {"chief+worker": (cluster.num_workers, train.workers, "train.workers")}
    else:
        counts = {}
    for job, (listed, configured, key) in counts.items():
        if listed != configured:
            found.append(_error("workers_mismatch", f"TF_CONFIG of {cluster.name} lists {listed} {job} task(s) but "
                                                    f"{key} is {configured} in the config; set {key}: {listed} so "
                                                    "the shard plan covers every task"))
    return found


def validate_cluster(config: PipelineConfig, environ: Mapping[str, str] | None = None) -> ClusterReport:
    """Check the configured strategy against this machine and TF_CONFIG, and report what is there.

    Only physical devices are listed, so TensorFlow's runtime is not initialised and
    `tf.config.set_logical_device_configuration` still works afterwards in this process.

    Args:
        config: the pipeline config (`train.strategy`, `train.cpu_replicas`, `train.workers`...).
        environ: the environment to read TF_CONFIG and TF_*/XLA_FLAGS from; default os.environ.

    Returns:
        The ClusterReport, warnings included.

    Raises:
        ClusterConfigError: when any finding is an error; the message lists them all and
            `error.report` holds the report.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "").strip()
    findings: list[Finding] = []
    cluster = None
    if text:
        findings += check_tf_config(text, config.train.strategy, "TF_CONFIG")
        if not any(f.level == "error" for f in findings):
            cluster = cluster_from_env({"TF_CONFIG": text})
    devices = visible_devices()
    if not text or cluster is not None:
        findings += _device_findings(config, devices, environ, cluster)
    report = ClusterReport(
        strategy=config.train.strategy.value,
        tf_config_set=bool(text),
        task=cluster.name if cluster is not None else None,
        cluster=dict(cluster.cluster) if cluster is not None else {},
        num_workers=cluster.num_workers if cluster is not None else config.train.workers,
        versions=package_versions(),
        tf_build=tf_build_info(),
        devices=devices,
        gpus=visible_gpus(environ),
        env=relevant_env(environ),
        findings=tuple(findings),
    )
    for finding in report.warnings:
        logger.warning("cluster check [%s]: %s", finding.rule, finding.message)
    if report.errors:
        raise ClusterConfigError(format_findings(findings, "the cluster check"), findings, report)
    logger.info("cluster check passed: strategy %s, %d GPU(s), TF_CONFIG %s", report.strategy, len(report.gpus),
                "set" if text else "not set")
    return report
